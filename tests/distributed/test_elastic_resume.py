"""A job restarted on another number of ranks (an elastic `--nnodes=MIN:MAX`, a node replaced by
a smaller one) resumes in the layout its config gives for the new world, keeps the global batch
by accumulating over more (or fewer) micro-batches, says so, and trains the same function: its
losses equal the single process's to fp32 rounding."""

import json
from pathlib import Path

from equivalence import TINY, assert_same_losses, reference

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.training.loop import train

STEPS = ("train.steps=6", "checkpoint.interval=3")


def _train(overrides: tuple[str, ...]) -> None:
    train(load_config(None, list(overrides)))


def _losses(out_dir: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["loss"], row["grad_norm"]) for row in rows]


def test_four_ranks_resumed_on_two_keep_the_global_batch_and_the_single_process_losses(
    builtin_corpus, tmp_path, capfd
):
    run = (*TINY, *STEPS, f"train.out_dir={tmp_path}")
    run_ranks(4, _train, (*run, "train.steps=3"))  # dp 4: one micro-batch of 2 per rank
    capfd.readouterr()
    run_ranks(2, _train, run)  # dp 2: two micro-batches of 2 per rank, the same batch of 8
    out = capfd.readouterr().out
    assert (
        "resuming in another layout: world size 4 -> 2: layout tp 1 pp 1 dp 4 -> tp 1 pp 1 "
        "dp 2, the same global batch of 8 as 1 -> 2 micro-batches of 2 per data-parallel rank"
    ) in out
    single_losses, _ = reference((*TINY, *STEPS))
    assert_same_losses(_losses(tmp_path), single_losses)
