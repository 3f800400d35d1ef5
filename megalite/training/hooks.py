"""What the training loop does after each step, as small pieces with one interface. A hook gets
the step's `StepRecord` in `after_step`, may add to its metrics row, and is closed when the run
reaches its last step. The loop calls its hooks in order; a new concern of the run (signals, a
watchdog, a profiler window, asynchronous saves, a bad-step policy) is a new hook with its own
test, not a branch in the loop.

The loop reads a step's metrics from the device only where a hook needs them then
(`reads_at`: a log, an evaluation, a checkpoint, the last step); in between the host launches
step after step without waiting. At a read every step since the last one reaches the hooks, in
order, and only the newest (`StepRecord.newest`) is the step the weights are at."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megalite.checkpoint.sharded import is_good, newest_good_checkpoint
from megalite.errors import MegaliteError
from megalite.optimizer.bad_steps import BadStepPolicy
from megalite.training.metrics import MetricsLogger, summary_line
from megalite.training.step import StepMetrics


class TrainingError(MegaliteError):
    """Training cannot go on (for example the loss became NaN)."""


@dataclass
class StepRecord:
    """One finished step, as the hooks see it."""

    step: int
    """Steps done, this one included."""
    metrics: StepMetrics
    lr: float
    elapsed_s: float
    row: dict[str, float]
    """The step's metrics row (metrics.jsonl, wandb); hooks add to it, e.g. `val_loss`."""
    checkpoint: Path | None = None
    """Where this step was saved, when it was."""
    newest: bool = True
    """Whether the weights are at this step: the last one launched, where the loop read. A
    hook that acts on the run (saves, stops) acts on the newest record alone."""


class Hook:
    """Base of the loop's hooks: override what the hook needs."""

    def reads_at(self, step: int) -> bool:
        """Whether this hook acts after `step` (steps done), so that the loop must read that
        step's metrics before it launches the next."""
        return False

    def after_step(self, record: StepRecord) -> None:
        """Called on every rank for every step, in the order of the loop's list, at the read
        that follows it."""

    def close(self) -> None:
        """Called once the last step is done."""


def due(step: int, interval: int, last: int) -> bool:
    """Every `interval` steps (never when 0), and on the last step."""
    return (interval > 0 and step % interval == 0) or step == last


class BadSteps(Hook):
    """The bad-step policy's (`optimizer/bad_steps.py`) count in the metrics row (`bad_steps`),
    and the stop after fault.max_bad_steps bad steps in a row, naming the step and the last good
    checkpoint: `last_good(step)` is the newest good one saved before `step`, where the weights
    the streak ran with were saved (bad steps skip their updates), once a save still being
    written is published. First in the list: the stopping step's row is logged here (`log`,
    collective), and nothing after it (an evaluation, a save) is worth having."""

    def __init__(
        self,
        policy: BadStepPolicy,
        last_good: Callable[[int], Path | None],
        log: Callable[[dict[str, float]], None],
    ) -> None:
        self.policy, self.last_good, self.log = policy, last_good, log

    def after_step(self, record: StepRecord) -> None:
        metrics = record.metrics
        record.row["bad_steps"] = metrics.bad_steps
        if metrics.bad is None or metrics.bad_in_a_row < self.policy.max_in_a_row:
            return
        self.log(record.row)
        good = self.last_good(record.step - metrics.bad_in_a_row)
        where = f"{good} (checkpoint.resume={good} continues from it)" if good else "none"
        raise TrainingError(
            f"{metrics.bad_in_a_row} bad steps in a row, the last at step {record.step} "
            f"({record.metrics.bad}): stopping. Last good checkpoint: {where}; lower "
            "optim.lr, raise optim.warmup_steps, or use train.precision=bf16/fp32 instead "
            "of fp16"
        )


class Evaluation(Hook):
    """Held-out loss every `interval` steps and after the last one; an interval beyond the
    run's length turns evaluation off. Collective: `evaluate` runs on every rank."""

    def __init__(
        self, evaluate: Callable[[], float], interval: int, steps: int, say: Callable[[str], None]
    ) -> None:
        self.evaluate, self.interval, self.steps, self.say = evaluate, interval, steps, say

    def reads_at(self, step: int) -> bool:
        return self.interval <= self.steps and due(step, self.interval, self.steps)

    def after_step(self, record: StepRecord) -> None:
        if not (record.newest and self.reads_at(record.step)):
            return
        val_loss = record.row["val_loss"] = self.evaluate()
        record.row["val_ppl"] = math.exp(min(val_loss, 50.0))
        self.say(f"step {record.step}: val_loss {val_loss:.4f} ppl {record.row['val_ppl']:.1f}")


class MetricsLogging(Hook):
    """A metrics row every `interval` steps, after the last one and with every evaluation; the
    progress bar at every step as it is read. Collective: every rank logs the same rows (the logger
    gathers the straggler and memory figures of all ranks into each)."""

    def __init__(self, logger: MetricsLogger, interval: int, steps: int) -> None:
        self.logger, self.interval, self.steps = logger, interval, steps

    def reads_at(self, step: int) -> bool:
        return due(step, self.interval, self.steps)

    def after_step(self, record: StepRecord) -> None:
        row = record.row
        if (record.newest and self.reads_at(record.step)) or "val_loss" in row:
            self.logger.log(row)
        postfix = {"loss": f"{row['loss']:.4f}", "lr": f"{row['lr']:.2e}"}
        self.logger.progress(record.step, {**postfix, "tok/s": f"{row['tokens_per_sec']:.0f}"})

    def close(self) -> None:
        self.logger.close()


class Checkpointing(Hook):
    """A checkpoint every `interval` steps (0: none on the way) and after the last one.
    Collective: `save` runs on every rank and returns the checkpoint's directory; `finish`
    (when given) completes a save still being written in the background, at the close, and
    `finish_written` (when given) after any step at which every rank has written it.
    During a streak of bad steps (`streak()` > 0) the weights are the ones that went bad: the
    periodic saves wait for a good step (said once per streak, through `say`), and the last
    step's save, which must happen, is marked bad by `save` itself."""

    def __init__(
        self,
        save: Callable[[], Path],
        interval: int,
        steps: int,
        finish: Callable[[], Path | None] | None = None,
        streak: Callable[[], int] | None = None,
        say: Callable[[str], None] = print,
        finish_written: Callable[[], Path | None] | None = None,
    ) -> None:
        self.save, self.interval, self.steps, self.finish = save, interval, steps, finish
        self.streak, self.say = streak or (lambda: 0), say
        self.finish_written = finish_written
        self.told = False

    def reads_at(self, step: int) -> bool:
        return due(step, self.interval, self.steps)

    def after_step(self, record: StepRecord) -> None:
        if not record.newest:
            return
        if self.finish_written is not None:
            self.finish_written()
        streak = self.streak()
        self.told = self.told and streak > 0
        if not self.reads_at(record.step):
            return
        if streak == 0 or record.step == self.steps:
            record.checkpoint = self.save()
        elif not self.told:
            self.told = True
            self.say(
                f"step {record.step}: no checkpoint during a bad-step streak ({streak} in a "
                "row); saving resumes after a good step"
            )

    def close(self) -> None:
        if self.finish is not None:
            self.finish()


class Summary(Hook):
    """What the run's closing line reports: where it got, its last loss and val loss, its
    throughput over the steps of this run, and its newest checkpoint."""

    def __init__(self, start_step: int, tokens_per_step: int) -> None:
        self.start_step, self.tokens_per_step = start_step, tokens_per_step
        self.step, self.train_time_s = start_step, 0.0
        self.loss, self.val_loss, self.checkpoint = math.nan, None, None
        self.compiled: tuple[float, int] | None = None  # (compile seconds, recompiles)

    def after_step(self, record: StepRecord) -> None:
        self.step, self.loss = record.step, record.row["loss"]
        if "compile_s" in record.row:
            self.compiled = (record.row["compile_s"], record.row["recompiles"])
        self.train_time_s += record.elapsed_s
        self.val_loss = record.row.get("val_loss", self.val_loss)
        self.checkpoint = record.checkpoint or self.checkpoint

    def line(self) -> str:
        steps_run = self.step - self.start_step
        throughput = steps_run * self.tokens_per_step / self.train_time_s
        line = summary_line(
            self.step, steps_run, self.loss, self.val_loss, throughput, self.checkpoint
        )
        if self.checkpoint is not None and not is_good(self.checkpoint):
            good = newest_good_checkpoint(self.checkpoint.parent) or "none"
            line += f" (saved in a bad-step streak, so marked bad; the newest good one: {good})"
        if self.compiled is not None:
            seconds, recompiles = self.compiled
            line += f" (train.compile: {seconds:.1f} s compiling, {recompiles} recompiles)"
        return line
