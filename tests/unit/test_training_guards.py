"""The training loop's guards: the bad-step policy (NaN / inf losses and gradients, loss spikes)
skips updates and stops after K in a row with a clear error, the watchdog's report names the
silent rank, the fault config governs the collective time-out, and Weights & Biases without an
API key logs offline instead of failing or hanging."""

import math

import pytest
import torch
from run_configs import ONE_LAYER

import megalite.training.loop as loop
import megalite.training.step as step_module
from megalite.checkpoint.sharded import is_good, read_manifest
from megalite.config import ConfigError, load_config
from megalite.optimizer.bad_steps import GOOD, SPIKE, BadStepPolicy
from megalite.parallel_state import ParallelState
from megalite.training.watchdog import Heartbeat, hang_report

TINY = ONE_LAYER


def test_nan_losses_skip_their_updates_then_stop_naming_the_last_good_checkpoint(
    builtin_corpus, tmp_path, monkeypatch
):
    """Steps 5 and 6 run with the weights saved at step 4 (a bad step skips its update) and
    stop the run: step 4's save is demoted, and the last good state is step 2's."""
    real_loss, losses, runs = step_module.global_loss, [], []

    def nan_from_step_5(local, run):
        loss = real_loss(local, run)
        losses.append(loss.item())
        runs.append(run)
        return loss.fill_(math.nan) if len(losses) >= 5 else loss

    monkeypatch.setattr(step_module, "global_loss", nan_from_step_5)
    overrides = ["train.steps=8", "checkpoint.interval=2", "fault.max_bad_steps=2"]
    cfg = load_config(None, [*TINY, *overrides, f"train.out_dir={tmp_path}"])
    root = tmp_path / "checkpoints"
    last_good = root / "step_000002"
    with pytest.raises(
        loop.TrainingError,
        match=rf"2 bad steps in a row, the last at step 6 \(loss is nan\): stopping. Last good "
        rf"checkpoint: {last_good} \(checkpoint.resume=",
    ):
        loop.train(cfg)
    run = runs[-1]
    assert run.optimizer.step_count == 4  # steps 5 and 6 skipped their updates
    assert (root / "latest").read_text() == "step_000002"
    assert not is_good(root / "step_000004") and is_good(last_good)
    assert run.bad_steps.state_dict() == {"total": 2, "in_a_row": 2, "recent": losses[:4]}


def test_bad_step_counters_survive_a_resume(builtin_corpus, tmp_path, monkeypatch):
    real_loss, calls = step_module.global_loss, []

    def nan_at_step_2(local, run):
        loss = real_loss(local, run)
        calls.append(loss.item())
        return loss.fill_(math.nan) if len(calls) == 2 else loss

    monkeypatch.setattr(step_module, "global_loss", nan_at_step_2)
    overrides = [*TINY, "checkpoint.interval=3", f"train.out_dir={tmp_path}"]
    loop.train(load_config(None, [*overrides, "train.steps=3"]))
    saved = read_manifest(tmp_path / "checkpoints" / "step_000003")["trainer"]["bad_steps"]
    assert saved == {"total": 1, "in_a_row": 0, "recent": [calls[0], calls[2]]}
    row = loop.train(load_config(None, [*overrides, "train.steps=4"]))
    assert row["step"] == 4 and row["bad_steps"] == 1


def reason(policy: BadStepPolicy, loss: float, non_finite_grad: bool) -> str | None:
    """The policy's verdict on a step, in words, not counted."""
    verdict = policy.verdict(torch.tensor(loss), torch.tensor(float(non_finite_grad)))
    return policy.describe(verdict.tolist(), loss)


def count(policy: BadStepPolicy, reason: str | None, loss: float) -> None:
    """Count a step judged good (`reason` None) or bad."""
    policy.count(torch.tensor(GOOD if reason is None else SPIKE), torch.tensor(loss))


def test_a_loss_spike_is_bad_from_the_first_good_loss_on():
    policy = BadStepPolicy(max_in_a_row=2, spike_factor=3.0, window=4)
    assert reason(policy, 1e12, non_finite_grad=False) is None  # no good loss to judge by yet
    count(policy, None, 9.0)
    spike = reason(policy, 27.1, False)
    assert spike == "loss spike: 27.1 > 3 x 9, the median of the last 1 good losses"
    for loss in (8.0, 20.0, 7.0):
        assert reason(policy, loss, non_finite_grad=False) is None
        count(policy, None, loss)
    assert reason(policy, 25.5, False) is None  # 25.5 < 3 x median(9, 8, 20, 7) = 25.5
    spike = reason(policy, 25.6, False)
    assert spike == "loss spike: 25.6 > 3 x 8.5, the median of the last 4 good losses"
    count(policy, spike, 25.6)
    assert policy.recent_losses() == [9.0, 8.0, 20.0, 7.0]  # a bad loss joins no median
    assert (policy.total, policy.in_a_row, policy.exhausted) == (1, 1, False)
    count(policy, "loss is nan", math.nan)
    assert policy.exhausted
    count(policy, None, 6.0)
    assert (policy.total, policy.in_a_row, policy.recent_losses()) == (2, 0, [8.0, 20.0, 7.0, 6.0])


def test_the_default_spike_guard_catches_a_finite_divergence():
    """The issue's run: loss 8.06 at step 8 with lr 1e6, then 5.8e12 (finite) at step 9."""
    policy = BadStepPolicy.from_config(load_config(None, []).fault)
    for loss in (9.03, 8.90, 8.66, 8.44, 8.31, 8.21, 8.13, 8.06):
        assert reason(policy, loss, False) is None
        count(policy, None, loss)
    assert reason(policy, 5.8e12, False).startswith("loss spike: 5.8e+12 > 10 x 8.37")


@pytest.mark.parametrize(
    "loss, grad_norm, reason",
    [
        (math.nan, 1.0, "loss is nan"),
        (math.inf, 1.0, "loss is inf"),
        (2.0, math.inf, "gradient norm is not finite"),
        (2.0, math.nan, "gradient norm is not finite"),
        (2.0, 1.0, None),
    ],
)
def test_non_finite_losses_and_gradients_are_bad(loss, grad_norm, reason):
    policy = BadStepPolicy()
    verdict = policy.judge(torch.tensor(loss), torch.tensor(grad_norm), ParallelState.single())
    assert policy.describe(verdict.tolist(), loss) == reason
    assert policy.total == (reason is not None)


def test_the_policy_state_round_trips():
    policy = BadStepPolicy(window=3)
    for loss, reason in ((4.0, None), (math.nan, "loss is nan"), (3.0, None), (2.0, None)):
        count(policy, reason, loss)
    count(policy, "x", 9.0)
    restored = BadStepPolicy(window=3)
    restored.load_state_dict(policy.state_dict())  # a resume starts the streak at 0
    assert restored.state_dict() == {"total": 2, "in_a_row": 0, "recent": [4.0, 3.0, 2.0]}


def test_fault_config_is_validated():
    with pytest.raises(ConfigError, match=r"watchdog_timeout_s \(900.0\) must be below"):
        load_config(None, ["fault.watchdog_timeout_s=900", "fault.collective_timeout_s=600"])
    with pytest.raises(ConfigError, match="fault.loss_spike_factor must be > 1"):
        load_config(None, ["fault.loss_spike_factor=0.5"])
    with pytest.raises(ConfigError, match="fault.max_bad_steps must be >= 1"):
        load_config(None, ["fault.max_bad_steps=0"])


def test_the_collective_timeout_reaches_the_process_group(monkeypatch):
    seen = []
    monkeypatch.setattr(loop, "init_distributed", lambda device, timeout_s: seen.append(timeout_s))
    cfg = load_config(None, [*TINY, "fault.collective_timeout_s=42"])
    assert cfg.fault.watchdog_timeout_s == 14.0  # a third of it, unless set
    loop.setup_topology(cfg)
    assert seen == [42.0]


def _beat(
    rank, wrote_at, blocked_in=None, entered="all_reduce over ranks 0,1,2 (float32x1, call #9)"
):
    return Heartbeat(rank, 4, blocked_in, entered, 0.5, wrote_at, "node7", 100 + rank)


def test_the_hang_report_names_the_silent_rank_its_step_and_last_collective():
    me = Heartbeat(
        0, 4, "all_reduce over ranks 0,1,2 (float32x64, call #12)", "x", 3.2, 100.0, "n", 1
    )
    others = {1: _beat(1, 96.5), 2: _beat(2, 99.9, blocked_in="all_reduce ...")}
    report = hang_report(me, others, now=100.0, timeout_s=3, stale_after_s=1.8)
    assert report.splitlines() == [
        "watchdog: rank 0 made no progress for 3.2 s (fault.watchdog_timeout_s=3) at step 5: "
        "waits in all_reduce over ranks 0,1,2 (float32x64, call #12) (3.2 s)",
        "rank 1 (node7 pid 101) went silent 3.5 s ago; its last heartbeat: step 5, outside "
        "collectives, the last collective it entered: all_reduce over ranks 0,1,2 (float32x1, "
        "call #9)",
        "1 other rank(s) alive and waiting in a collective",
        "ending the job (exit status 124)",
    ]


def test_the_hang_report_without_a_silent_rank_names_the_one_outside_or_a_mismatch():
    me = Heartbeat(0, 4, "barrier over ranks 0,1,2 (-, call #12)", "x", 3.2, 100.0, "n", 1)
    busy = {1: _beat(1, 99.9), 2: _beat(2, 99.9, blocked_in="barrier")}
    assert "rank 1 (node7 pid 101) outside any collective for 0.5 s, the last it entered: all" in (
        hang_report(me, busy, 100.0, 3, 1.8)
    )
    waiting = {1: _beat(1, 99.9, blocked_in="all_reduce"), 2: _beat(2, 99.9, blocked_in="x")}
    assert "they disagree on which one" in hang_report(me, waiting, 100.0, 3, 1.8)
    never = hang_report(me, {1: None, 2: busy[2]}, 100.0, 3, 1.8)
    assert "rank 1 went silent: no heartbeat from it ever arrived" in never
    assert "the store did not answer" in hang_report(me, None, 100.0, 3, 1.8)


def test_wandb_without_api_key_logs_offline(builtin_corpus, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(
        None, [*TINY, "train.steps=2", "logging.wandb=true", f"train.out_dir={tmp_path}"]
    )
    loop.train(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
