"""An asynchronous save on several ranks is published only once every rank has written it:
the ranks agree after each step (`CheckpointSaver.finish_if_written`), so a writer slower on
one rank holds the publishing back on all of them, and every rank enters the same collectives
(`run_ranks` compares their traces)."""

import contextlib
from pathlib import Path

import torch
from run_configs import TWO_LAYERS

import megalite.training.step as step_module
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.testing.faults import stall_save
from megalite.training.loop import train


def _train(out_dir: str) -> list[str | None]:
    """Rank 1's writer of step 2 stalls 1 s; each rank records `latest` after every step."""
    latest, real_finalize = [], step_module.finalize_grads
    path = Path(out_dir) / "checkpoints" / "latest"

    def finalize_grads(buffers, ps):
        real_finalize(buffers, ps)
        latest.append(path.read_text() if path.exists() else None)

    step_module.finalize_grads = finalize_grads
    extra = ["train.steps=6", "checkpoint.interval=2", "checkpoint.async_save=true"]
    cfg = load_config(None, [*TWO_LAYERS, *extra, "parallel.zero=1", f"train.out_dir={out_dir}"])
    with stall_save(2, 1.0) if torch.distributed.get_rank() == 1 else contextlib.nullcontext():
        train(cfg)
    return latest


def test_a_slow_writer_on_one_rank_holds_back_the_publishing(tmp_path, builtin_corpus):
    first, second = run_ranks(2, _train, str(tmp_path))
    assert first == second  # the same `latest` after every step on both ranks
    assert first[:3] == [None] * 3  # step 2's save is published after step 3 at the earliest
    assert first[-1] in ("step_000002", "step_000004")  # before step 6, by its writers' pace
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000006"
