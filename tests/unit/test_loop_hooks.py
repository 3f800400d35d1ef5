"""The training loop's hooks, one at a time and without a run: each gets made-up step records
and must act on exactly the steps its policy names (evaluation, metrics rows, checkpoints), stop
on a NaN loss with the documented message, and sum up the run for its closing line."""

import math
import os
import signal
from pathlib import Path

import pytest
import torch

from megalite.optimizer.bad_steps import GOOD, SPIKE, BadStepPolicy
from megalite.pipeline.executor import StepTimes
from megalite.training.hooks import (
    BadSteps,
    Checkpointing,
    Evaluation,
    MetricsLogging,
    StepRecord,
    Summary,
    TrainingError,
    due,
)
from megalite.training.metrics import StepCost, metrics_row, summary_line
from megalite.training.step import StepMetrics

STEPS = 10


def record(step: int, loss: float = 2.0, elapsed_s: float = 0.5) -> StepRecord:
    metrics = StepMetrics(
        loss, grad_norm=1.0, skipped=False, bubble_fraction=0.0, times=StepTimes()
    )
    cost = StepCost(tokens=100, flops=1e12, devices=1, device_peak_flops=2e12)
    row = metrics_row(step, metrics, 1e-3, elapsed_s, cost)
    return StepRecord(step, metrics, 1e-3, elapsed_s, row)


def run_hook(hook, steps=range(1, STEPS + 1)) -> list[StepRecord]:
    records = [record(step) for step in steps]
    for r in records:
        hook.after_step(r)
    return records


@pytest.mark.parametrize(
    "interval, expected",
    [(3, [3, 6, 9, 10]), (5, [5, 10]), (1, list(range(1, 11))), (0, [10]), (20, [10])],
)
def test_due_every_interval_and_on_the_last_step(interval, expected):
    assert [step for step in range(1, STEPS + 1) if due(step, interval, STEPS)] == expected


def test_metrics_row():
    row = record(4, loss=3.0, elapsed_s=0.25).row
    assert row == {
        "step": 4,
        "loss": 3.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_sec": 400.0,
        "step_time_s": 0.25,
        "tflops": 4.0,
        "mfu": 2.0,
        "bubble_fraction": 0.0,
        "skipped_steps": 0,
        "loss_scale": 1.0,
    }
    unknown_peak = StepCost(tokens=100, flops=1e12, devices=1, device_peak_flops=None)
    assert metrics_row(1, record(1).metrics, 1e-3, 1.0, unknown_peak)["mfu"] is None
    # Rates are per device: four devices share the step's FLOPs, each against its own peak.
    four = StepCost(tokens=100, flops=1e12, devices=4, device_peak_flops=2e12)
    row = metrics_row(1, record(1).metrics, 1e-3, 0.25, four)
    assert (row["tflops"], row["mfu"], row["tokens_per_sec"]) == (1.0, 0.5, 400.0)


def test_bad_steps_counts_and_stops_after_k_in_a_row_naming_the_last_good_checkpoint():
    policy, logged, asked = BadStepPolicy(max_in_a_row=3), [], []

    def last_good(streak_weights: int):
        asked.append(streak_weights)
        return Path("ckpt/step_000005")

    hook = BadSteps(policy, last_good, logged.append)
    bad_at = {4, 6, 7, 8}
    for step in range(3, 9):
        r = record(step)
        r.metrics.bad = "loss is nan" if step in bad_at else None
        policy.count(torch.tensor(GOOD if r.metrics.bad is None else SPIKE), torch.tensor(2.0))
        r.metrics.bad_steps, r.metrics.bad_in_a_row = policy.total, policy.in_a_row  # as read
        if step == 8:
            with pytest.raises(
                TrainingError,
                match=r"3 bad steps in a row, the last at step 8 \(loss is nan\): stopping. "
                r"Last good checkpoint: ckpt/step_000005 \(checkpoint.resume=ckpt/step_000005",
            ):
                hook.after_step(r)
            break
        hook.after_step(r)
        assert r.row["bad_steps"] == len([s for s in bad_at if s <= step])
    assert [row["step"] for row in logged] == [8] and logged[0]["bad_steps"] == 4
    # asked only when stopping (it publishes a save in flight), for a checkpoint older than
    # step 5: the bad steps 6-8 skipped their updates, so they ran with step 5's weights
    assert asked == [5]


def test_bad_steps_before_any_checkpoint_say_there_is_none():
    policy = BadStepPolicy(max_in_a_row=1)
    r = record(1)
    r.metrics.bad = "gradient norm is not finite"
    r.metrics.bad_steps = r.metrics.bad_in_a_row = 1
    with pytest.raises(TrainingError, match=r"at step 1 \(gradient norm is not finite\).*: none;"):
        BadSteps(policy, lambda step: None, lambda row: None).after_step(r)


def test_evaluation_adds_val_loss_on_its_steps_and_says_so():
    said, calls = [], []

    def evaluate():
        calls.append(1)
        return 2.5

    records = run_hook(Evaluation(evaluate, 4, STEPS, said.append))
    assert [r.step for r in records if "val_loss" in r.row] == [4, 8, 10]
    assert len(calls) == 3
    assert records[3].row["val_loss"] == 2.5
    assert records[3].row["val_ppl"] == pytest.approx(math.exp(2.5))
    assert said == [f"step {s}: val_loss 2.5000 ppl 12.2" for s in (4, 8, 10)]


def test_evaluation_interval_beyond_the_run_turns_it_off():
    evaluation = Evaluation(lambda: pytest.fail("evaluated"), STEPS + 1, STEPS, print)
    assert not any("val_loss" in r.row for r in run_hook(evaluation))


class FakeLogger:
    def __init__(self):
        self.rows, self.progress_calls, self.closed = [], [], False

    def log(self, row):
        self.rows.append(row["step"])

    def progress(self, step, postfix):
        self.progress_calls.append((step, postfix))

    def close(self):
        self.closed = True


def test_metrics_logging_cadence_progress_and_close():
    logger = FakeLogger()
    hook = MetricsLogging(logger, 4, STEPS)
    records = [record(step) for step in range(1, STEPS + 1)]
    records[4].row["val_loss"] = 2.0  # step 5 was evaluated: its row is logged too
    for r in records:
        hook.after_step(r)
    assert logger.rows == [4, 5, 8, 10]
    assert [step for step, _ in logger.progress_calls] == list(range(1, STEPS + 1))
    assert logger.progress_calls[0][1] == {"loss": "2.0000", "lr": "1.00e-03", "tok/s": "200"}
    assert not logger.closed
    hook.close()
    assert logger.closed


@pytest.mark.parametrize("interval, saved", [(3, [3, 6, 9, 10]), (0, [10])])
def test_checkpointing_saves_on_its_steps(interval, saved):
    paths = []

    def save():
        paths.append(Path(f"step_{len(paths) + 1}"))
        return paths[-1]

    records = run_hook(Checkpointing(save, interval, STEPS))
    assert [r.step for r in records if r.checkpoint is not None] == saved
    assert [r.checkpoint for r in records if r.checkpoint is not None] == paths


def test_checkpointing_waits_out_a_bad_step_streak_but_saves_the_last_step():
    """Due every 2 steps; steps 3-6, 8 and 10 are bad: 4, 6 and 8 are not saved (said once per
    streak), 10, the last step, is saved although bad (`save` marks it bad)."""
    streaks = dict(zip(range(1, 11), [0, 0, 1, 2, 3, 4, 0, 1, 0, 1]))
    step, said = [0], []
    hook = Checkpointing(
        lambda: Path(f"step_{step[0]}"), 2, STEPS, streak=lambda: streaks[step[0]], say=said.append
    )
    saved = []
    for r in [record(s) for s in range(1, STEPS + 1)]:
        step[0] = r.step
        hook.after_step(r)
        saved += [r.step] if r.checkpoint else []
    assert saved == [2, 10]
    assert said == [
        f"step {s}: no checkpoint during a bad-step streak ({n} in a row); saving resumes after "
        "a good step"
        for s, n in ((4, 2), (8, 1))
    ]


def test_summary_of_a_resumed_run():
    summary = Summary(start_step=6, tokens_per_step=100)
    records = [record(step, loss=3.0 - step / 10) for step in range(7, 11)]
    records[0].row["val_loss"] = 2.5  # the last evaluation was at step 7
    records[1].checkpoint = Path("ckpt/step_000008")  # and the newest checkpoint at step 8
    for r in records:
        summary.after_step(r)
    expected = summary_line(10, 4, 2.0, 2.5, 4 * 100 / (4 * 0.5), Path("ckpt/step_000008"))
    assert summary.line() == expected
    assert summary.line().startswith("trained to step 10 (4 steps in this run): loss 2.0000")


def test_preemption_saves_the_signalled_step_once_and_exits_with_its_code():
    from megalite.parallel_state import ParallelState
    from megalite.training.preemption import (
        PREEMPTED_EXIT_CODE,
        Preempted,
        Preemption,
        StopSignals,
    )

    saved, finished = [], []
    before = signal.getsignal(signal.SIGTERM)
    hook = Preemption(
        ParallelState.single(),
        save=lambda: saved.append(1) or Path("checkpoints/step_000004"),
        finish=lambda: finished.append(1),
        last_step=10,
        signals=StopSignals(),
    )
    try:
        hook.after_step(record(3))  # no signal: the run goes on
        assert saved == finished == []
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal is only noted
        with pytest.raises(Preempted) as stop:
            hook.after_step(record(4))
    finally:
        hook.close()
    assert stop.value.code == PREEMPTED_EXIT_CODE
    assert str(stop.value).startswith("preempted (SIGUSR1) after step 4, saved as checkpoints/")
    assert saved == finished == [1]
    assert signal.getsignal(signal.SIGTERM) is before

    saved.clear()
    hook = Preemption(ParallelState.single(), lambda: saved.append(1), lambda: None, 10)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        already = record(5)
        already.checkpoint = Path("checkpoints/step_000005")  # the checkpoint hook saved it
        with pytest.raises(Preempted) as stop:
            hook.after_step(already)
    finally:
        hook.close()
    assert saved == [] and stop.value.checkpoint == already.checkpoint
