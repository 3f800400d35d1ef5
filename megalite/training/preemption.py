"""Preemption: a cluster that takes the machines back (Slurm before a time limit or a
higher-priority job, Kubernetes before evicting a pod) first sends SIGTERM or SIGUSR1, then
kills. On either signal the run finishes the step it is on, saves a checkpoint of that step,
and exits with `PREEMPTED_EXIT_CODE`; running the same command again continues from it.

The signal may reach only some ranks (a node's processes are signalled by their own agent), so
the ranks agree through a max all-reduce of a one-element flag over the world: all stop after
the same step, and the save, which is collective, runs on all of them. They ask at each step
the loop reads (`training/hooks.py`), every `train.log_interval` steps at least, where the
host waits for the device anyway: a grace period must outlast that many steps. A second
signal while saving is only noted: nothing interrupts the save, and the checkpoint is published
by a rename when complete, so even the SIGKILL that follows a grace period cannot leave a
half-written `latest`."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch

from megalite import comm
from megalite.checkpoint.sharded import is_good, newest_good_checkpoint
from megalite.parallel_state import ParallelState
from megalite.training.hooks import Hook, StepRecord

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run that stopped for a preemption signal after saving its step: EX_TEMPFAIL
of sysexits.h, "temporary failure, try again". Distinct from success (0), a crash (1), a
usage error (2) and a death by signal (128 + n: 143 for SIGTERM, 137 for SIGKILL), so a job
script can tell "requeue me" from "broken"."""

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised on every rank once the preempted step is saved; exits the process with
    PREEMPTED_EXIT_CODE (a SystemExit: no traceback)."""

    def __init__(self, reason: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.reason, self.step, self.checkpoint = reason, step, checkpoint

    def __str__(self) -> str:
        """The line rank 0 prints, with what the same command continues from: the save itself,
        or (saved during a bad-step streak, so marked bad) the newest good checkpoint, read from
        their directory here, by the one rank that says it."""
        saved = f"preempted ({self.reason}) after step {self.step}, saved as {self.checkpoint}"
        if self.checkpoint is None or is_good(self.checkpoint):
            return (
                f"{saved}; exit code {PREEMPTED_EXIT_CODE}: run the same command again to continue"
            )
        bad = f"{saved}, marked bad (a bad-step streak was running)"
        continues_from = newest_good_checkpoint(self.checkpoint.parent)
        if continues_from is None:
            return (
                f"{bad}; exit code {PREEMPTED_EXIT_CODE}, but there is no good checkpoint to "
                f"continue from: continue the streak with checkpoint.resume={self.checkpoint}, "
                "or start afresh in another train.out_dir"
            )
        return (
            f"{bad}; exit code {PREEMPTED_EXIT_CODE}: the same command continues from "
            f"{continues_from}, the newest good checkpoint"
        )


class StopSignals:
    """Catches the preemption signals while installed. The first sets `received`; any later
    one is reported and otherwise ignored, so it cannot interrupt the save."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> StopSignals:
        """Take over the signals (only the main thread may; elsewhere this does nothing)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back to whoever handled them before."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            print(f"{name} received: saving after this step, then exiting", file=sys.stderr)
        else:
            print(f"{name} received again: still saving, ignored", file=sys.stderr)


class Preemption(Hook):
    """At each step the loop reads but the last: if any rank caught a preemption signal, every
    rank saves this step (unless the checkpoint hook just did), completes the save, and raises
    `Preempted`. After the last step the run ends anyway, exiting 0 once its last save is
    published: a requeue would only find it done. Collective: one max all-reduce of a flag
    over the world at each read."""

    def __init__(
        self,
        ps: ParallelState,
        save: Callable[[], Path],
        finish: Callable[[], Path | None],
        last_step: int,
        signals: StopSignals | None = None,
    ) -> None:
        self.ps, self.save, self.finish, self.last_step = ps, save, finish, last_step
        self.signals = (signals or StopSignals()).install()

    def stop_requested(self) -> bool:
        """Whether any rank has caught a signal; the same answer on every rank."""
        flag = torch.tensor([float(self.signals.received is not None)], device=self.ps.device)
        if self.ps.world_size > 1:
            comm.all_reduce_max(flag, self.ps.world_group)
        return bool(flag.item())

    def after_step(self, record: StepRecord) -> None:
        if not record.newest or record.step == self.last_step or not self.stop_requested():
            return
        checkpoint = record.checkpoint or self.save()
        checkpoint = self.finish() or checkpoint  # an asynchronous save is published here
        reason = self.signals.received or "a signal to another rank"
        self.signals.restore()
        stop = Preempted(reason, record.step, checkpoint)
        if self.ps.rank == 0:
            print(stop, flush=True)
        raise stop

    def close(self) -> None:
        self.signals.restore()
