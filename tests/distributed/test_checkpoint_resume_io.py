"""A resuming rank reads its share of a checkpoint, not dp times it: the weights it holds and the
optimizer state of the ranges it owns, only the byte ranges of the files it needs (each block
verified as read), at the saved layout and at another dp. Counted by the kernel (`rchar` in
/proc/self/io: every byte a read system call returned; the manifest aside), at a toy size and
at gpt-tiny's."""

from pathlib import Path

import numpy as np
import pytest
import torch
from equivalence import TINY

from megalite.checkpoint.sharded import load_checkpoint, read_manifest
from megalite.checkpoint.writer import save_checkpoint
from megalite.config import load_config
from megalite.data import GlobalBatchSampler
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.tensor_parallel import global_tensors
from megalite.training.loop import run_state
from megalite.training.setup import build_run

GPT_TINY = "configs/gpt-tiny.yaml"
SETTINGS = ("parallel.zero=1", "train.device=cpu", "train.precision=fp32")


def _state(config: str | None, overrides: tuple[str, ...]):
    cfg = load_config(config, [*overrides, *SETTINGS])
    ps = build_parallel_state(1, 1, torch.device("cpu"))
    run = build_run(cfg, ps)
    sampler = GlobalBatchSampler(1000, cfg.train.global_batch_size, cfg.train.seed)
    return run_state(run, sampler), run


def _owned(state) -> dict[tuple[str, str, int], np.ndarray]:
    """The optimizer state a rank owns, as numpy arrays (a forked rank returns no tensors)."""
    return {
        (name, kind, lo): view.numpy().copy()
        for name, _, lo, _, views in state.optimizer.owned_pieces()
        for kind, view in views.items()
    }


def _save(root: str, config: str | None, overrides: tuple[str, ...]):
    """Save a state whose Adam moments are random (a fresh optimizer's are zeros)."""
    state, _ = _state(config, overrides)
    generator = torch.Generator().manual_seed(state.ps.rank)
    for *_, views in state.optimizer.owned_pieces():
        for kind, view in views.items():
            if kind != "master":  # the weights themselves (fp32): saved in the model files too
                view.copy_(torch.randn(view.shape, generator=generator))
    state.step = 3
    save_checkpoint(Path(root), state, keep=1)
    return _owned(state)


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _load(path: str, config: str | None, overrides: tuple[str, ...]):
    state, run = _state(config, overrides)
    load_checkpoint(Path(path), state)  # once to import whatever loading imports
    before = _read_bytes()
    load_checkpoint(Path(path), state)
    read = _read_bytes() - before
    held = sum(p.numel() * p.element_size() for p in state.params.values())
    owned = _owned(state)
    share = held + sum(v.nbytes for v in owned.values())
    pieces = global_tensors(state.params)  # as saved: fused parameters by part
    return read, share, owned, {n: p.detach().numpy().copy() for n, p in pieces.items()}


def _global(pieces: list[dict]) -> dict[tuple[str, str], np.ndarray]:
    """Each optimizer state's whole flat tensor, glued from what the saving ranks owned."""
    glued: dict[tuple[str, str], list] = {}
    for rank_pieces in pieces:
        for (name, kind, lo), values in rank_pieces.items():
            glued.setdefault((name, kind), []).append((lo, values))
    return {
        key: np.concatenate([v for _, v in sorted(parts, key=lambda part: part[0])])
        for key, parts in glued.items()
    }


@pytest.mark.parametrize(
    "config, overrides",
    [(None, TINY), (GPT_TINY, ())],
    ids=["toy", "gpt-tiny"],
)
def test_a_resuming_rank_reads_its_share(tmp_path, config, overrides):
    saved = _global(run_ranks(2, _save, str(tmp_path), config, overrides, timeout=300))
    path = tmp_path / "step_000003"
    manifest_bytes = (path / "manifest.json").stat().st_size
    assert read_manifest(path)["format"] == "megalite-checkpoint-v4"
    for world_size in (2, 4):  # the saved dp, then another
        results = run_ranks(world_size, _load, str(path), config, overrides, timeout=300)
        for rank, (read, share, owned, params) in enumerate(results):
            ratio = (read - manifest_bytes) / share
            print(f"dp={world_size} rank {rank}: read {read} B, share {share} B ({ratio:.3f}x)")
            assert ratio <= 1.1, f"dp={world_size} rank {rank} read {ratio:.2f}x its share"
            for (name, kind, lo), values in owned.items():  # exactly what was saved
                assert np.array_equal(values, saved[name, kind][lo : lo + values.size])
            for name, value in params.items():
                assert np.array_equal(value.reshape(-1), saved[name, "master"]), name
