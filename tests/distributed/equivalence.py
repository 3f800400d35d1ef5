"""The equivalence principle as a test helper: train a parallel layout on gloo ranks and the
single-process run of the same config, then compare per-step losses and the final weights
(read back from each run's checkpoint as full global tensors)."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.sharded import Checkpoint, resolve_checkpoint
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.training.loop import train

TINY = (
    "model.n_layers=4",
    "model.hidden=64",
    "model.n_heads=4",
    "model.vocab_size=500",
    "model.seq_len=32",
    "train.steps=10",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.eval_interval=1000",
    "train.log_interval=1",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "checkpoint.interval=0",
    "logging.progress=false",
)


def _train(config: str | None, overrides: tuple[str, ...], out_dir: str) -> None:
    train(load_config(config, [*overrides, f"train.out_dir={out_dir}"]))


def train_each(runs: list[tuple[tuple[str, ...], str]]) -> None:
    """Train each (overrides, out_dir) one after the other: several runs in one launch of the
    ranks (`run_ranks(world, train_each, runs)`)."""
    for overrides, out_dir in runs:
        train(load_config(None, [*overrides, f"train.out_dir={out_dir}"]))


def run_layout(
    world_size: int, overrides: tuple[str, ...], out_dir: Path, config: str | None = None
):
    """Train on `world_size` ranks; returns (losses per step, final weights by global name).
    `config`: a YAML file the overrides apply to (the defaults when None)."""
    run_ranks(world_size, _train, config, overrides, str(out_dir))
    return read_run(out_dir)


def read_run(out_dir: Path):
    """(losses per step, final weights by global name) of the run trained in `out_dir`."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(row["loss"], row["grad_norm"]) for row in rows]
    checkpoint = Checkpoint(resolve_checkpoint(out_dir))  # the newest: the final weights
    weights = {name: checkpoint.tensor(name) for name in checkpoint.weight_names()}
    return losses, weights


SAVE_AT_5 = ("checkpoint.interval=5", "checkpoint.keep=5")
"""Checkpoint at steps 5 and 10 of TINY's 10, both kept: `rewind_to_step_5` then resumes."""


def rewind_to_step_5(run_dir: Path) -> None:
    """Make a finished SAVE_AT_5 run look as if it crashed after step 5: its step-10 checkpoint
    gone, `latest` at step 5 and no metrics, so the next launch resumes there."""
    checkpoints = Path(run_dir) / "checkpoints"
    shutil.rmtree(checkpoints / "step_000010")
    (checkpoints / "latest").write_text("step_000005")
    (Path(run_dir) / "metrics.jsonl").write_text("")


EVAL = ("train.eval_interval=5", "train.eval_steps=2")
"""Evaluate twice in the 10 steps."""


def run_in_scratch(overrides: tuple[str, ...], config: str | None = None):
    """`run_layout` of the single process in a directory removed once read: a run at a shipped
    config's width leaves a quarter GiB of checkpoints, which a session's many references would
    otherwise pile up in the temp dir."""
    with tempfile.TemporaryDirectory(prefix="megalite-ref-") as out_dir:
        return run_layout(1, overrides, Path(out_dir), config)


@functools.cache
def reference(overrides: tuple[str, ...], config: str | None = None):
    """The single-process run of a config (cached: many layouts compare with the same one)."""
    return run_in_scratch(overrides, config)


def assert_same_losses(
    losses: list, ref_losses: list, rtol: float = 1e-5, norm_rtol: float | None = None
) -> None:
    """Per-step (loss, grad norm) pairs equal the reference's within `rtol` (the norm within
    `norm_rtol` where given), relatively."""
    assert len(losses) == len(ref_losses)
    norm_rtol = rtol if norm_rtol is None else norm_rtol
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(losses, ref_losses), 1):
        assert abs(loss - ref_loss) <= rtol * ref_loss, f"step {step}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= norm_rtol * ref_norm, (
            f"step {step}: grad norm {norm} vs {ref_norm}"
        )


def assert_equivalent(
    world_size: int,
    model: tuple[str, ...],
    layout: tuple[str, ...],
    out_dir: Path,
    loss_rtol: float = 1e-5,
    weight_rtol: float = 3e-5,
    norm_rtol: float | None = None,
) -> tuple[list, list]:
    """Per-step loss and gradient norm within loss_rtol (the norm within norm_rtol where
    given); every final weight within weight_rtol by relative Frobenius error. Adam divides by
    sqrt(v), which magnifies fp32 rounding in elements with tiny gradients: merely regrouping
    the single-process run's micro-batches moves final weights by up to 2e-6, and tp = 4 by up
    to 1.2e-5 (halving with the lr)."""
    losses, weights = run_layout(world_size, TINY + model + layout, out_dir)
    return assert_equals_reference(model, losses, weights, loss_rtol, weight_rtol, norm_rtol)


def assert_equals_reference(
    model: tuple[str, ...],
    losses: list,
    weights: dict[str, torch.Tensor],
    loss_rtol: float = 1e-5,
    weight_rtol: float = 3e-5,
    norm_rtol: float | None = None,
) -> tuple[list, list]:
    """`assert_equivalent`'s comparison, of a run already trained (`read_run`) with the
    single process of `TINY + model`."""
    ref_losses, ref_weights = reference(TINY + model)
    assert len(ref_losses) == 10
    assert_same_losses(losses, ref_losses, loss_rtol, norm_rtol)
    assert ref_losses[-1][0] < ref_losses[0][0] - 0.1, "the reference run did not learn"
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        if name.endswith("attn.wk.bias"):
            # The key bias adds q.b to every score of a query, which softmax cancels: its exact
            # gradient is zero, so Adam turns rounding noise into full steps in every layout.
            continue
        error = relative_error(weights[name].float(), ref.float())
        assert error <= weight_rtol, f"{name}: relative error {error:.2e} vs single-process"
    return losses, ref_losses


def _val_losses(out_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["val_loss"] for row in rows if "val_loss" in row]


@functools.cache
def _reference_val_losses(model: tuple[str, ...]) -> list[float]:
    """Validation losses of the single-process run (cached: several layouts compare with it)."""
    with tempfile.TemporaryDirectory(prefix="megalite-ref-") as out_dir:
        run_layout(1, TINY + model, Path(out_dir))
        return _val_losses(Path(out_dir))


def assert_same_val_losses(model: tuple[str, ...], out_dir: Path) -> None:
    """The run in `out_dir` (of `TINY + model + EVAL`'s two evaluations, its layout aside)
    evaluated as the single process does, within 1e-5."""
    val_losses, ref_val_losses = _val_losses(out_dir), _reference_val_losses(model)
    assert len(val_losses) == len(ref_val_losses) == 2
    assert val_losses == pytest.approx(ref_val_losses, rel=1e-5)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
