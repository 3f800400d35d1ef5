"""NaN gradients injected on one data-parallel rank: every rank skips that step's update (they
agree, although the NaN reaches only that rank's gradient norm), the step is counted in the
metrics, no periodic checkpoint is saved during a streak, and max_bad_steps bad steps in a row
stop the run naming the step and the last good checkpoint, the stopping step's metrics row
written. The streak of steps 5-7 ran with the weights saved at step 4, which is demoted: the last
good checkpoint is step 2's."""

import hashlib
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from run_configs import ONE_LAYER

import megalite.training.loop as loop
import megalite.training.step as step_module
from megalite.checkpoint.sharded import Checkpoint
from megalite.config import load_config
from megalite.launch import run_ranks

NAN_RANK = 1
NAN_STEPS = {3, 5, 6, 7}  # one isolated bad step, then three in a row


def _weights(run) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in run.named_parameters().values()])


def _train_with_nan_grads(out_dir: str) -> dict:
    """Train with NaN written into this rank's reduced gradients on NAN_STEPS (after the dp
    reduction: only this rank's copy, and so only its own gradient norm, sees it)."""
    real_finalize, real_step = step_module.finalize_grads, loop.launch_step
    steps, weights, error = [], {}, None

    def finalize_grads(buffers, ps):
        real_finalize(buffers, ps)
        if dist.get_rank() == NAN_RANK and len(steps) in NAN_STEPS:
            buffers[0].owned_grads[0] = math.nan

    def launch_step(run, tokens, lr):
        steps.append(run)
        before = _weights(run)
        launched = real_step(run, tokens, lr)
        weights[len(steps)] = (before, _weights(run), launched.read().bad)
        return launched

    step_module.finalize_grads, loop.launch_step = finalize_grads, launch_step
    overrides = [
        *ONE_LAYER,
        "train.steps=10",
        "train.global_batch_size=4",
        "checkpoint.interval=2",
        "fault.max_bad_steps=3",
        f"train.out_dir={out_dir}",
    ]
    try:
        loop.train(load_config(None, overrides))
    except loop.TrainingError as stop:
        error = str(stop)
    return {
        "error": error,
        "bad": {step: bad for step, (_, _, bad) in weights.items()},
        "unchanged": {step: torch.equal(a, b) for step, (a, b, _) in weights.items()},
        "final": hashlib.sha256(weights[len(steps)][1].numpy().tobytes()).hexdigest(),
        "counters": steps[-1].bad_steps.state_dict(),
    }


def test_nan_gradients_on_one_rank_are_skipped_everywhere_and_stop_the_run(
    builtin_corpus, tmp_path
):
    ranks = run_ranks(2, _train_with_nan_grads, str(tmp_path), timeout=120)
    last_good = tmp_path / "checkpoints" / "step_000002"
    for result in ranks:
        assert result["error"].startswith(
            "3 bad steps in a row, the last at step 7 (gradient norm is not finite): stopping. "
            f"Last good checkpoint: {last_good} (checkpoint.resume={last_good} continues from it)"
        ), result["error"]
        assert sorted(result["bad"]) == list(range(1, 8))
        assert {s for s, bad in result["bad"].items() if bad} == NAN_STEPS
        assert {s for s, same in result["unchanged"].items() if same} == NAN_STEPS
        assert result["counters"]["total"] == 4 and result["counters"]["in_a_row"] == 3
    assert ranks[0]["final"] == ranks[1]["final"]  # the replicas never parted
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {row["skipped_steps"] for row in rows} == {0}  # fp16 overflow keeps its own count
    assert [(row["step"], row["bad_steps"]) for row in rows] == [
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 1),
        (5, 2),
        (6, 3),
        (7, 4),  # the stopping step
    ]
    assert Path(last_good, "manifest.json").is_file()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == ["step_000002", "step_000004"]  # step 6 fell in the streak of 5, 6, 7
    assert not Checkpoint(tmp_path / "checkpoints" / "step_000004").good


def _train_with_nan_in_the_tied_head(out_dir: str) -> list[str | None]:
    """Two pipeline stages with tied embeddings: NaN written, after the reductions, into the
    last stage's copy of the embedding's gradient, which the gradient norm leaves out (the
    first stage counts the original) but the optimizer applies."""
    real_finalize, real_step = step_module.finalize_grads, loop.launch_step
    runs, bad = [], []

    def finalize_grads(buffers, ps):
        real_finalize(buffers, ps)
        if len(runs) == 2:
            for param in runs[-1].named_parameters().values():
                if param.meta.tied_name is not None:
                    param.main_grad.view(-1)[0] = math.nan

    def launch_step(run, tokens, lr):
        runs.append(run)
        launched = real_step(run, tokens, lr)
        bad.append(launched.read().bad)
        return launched

    step_module.finalize_grads, loop.launch_step = finalize_grads, launch_step
    overrides = [*ONE_LAYER, "model.n_layers=2", "parallel.pp=2", "train.steps=3"]
    loop.train(load_config(None, [*overrides, "checkpoint.interval=0", f"train.out_dir={out_dir}"]))
    return bad


def test_nan_in_a_copy_the_gradient_norm_leaves_out_is_a_bad_step(builtin_corpus, tmp_path):
    ranks = run_ranks(2, _train_with_nan_in_the_tied_head, str(tmp_path), timeout=120)
    assert ranks == [[None, "gradient norm is not finite", None]] * 2, ranks
