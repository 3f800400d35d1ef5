"""The step watchdog: a rank that stops making progress ends the job within
`fault.watchdog_timeout_s`, with a message naming the rank that went silent, its step and the
last collective it entered, instead of hanging until the collective time-out (or for ever).

Which rank detects what. A rank stopped outright (SIGSTOP, a frozen node) cannot speak, so its
peers speak for it. Every rank publishes a heartbeat to the job's store (torch.distributed's
default TCPStore) a few times per time-out: its step, the call it is blocked in, the last call
it entered, how long it has been idle, and the wall-clock time it wrote. A rank whose training
thread has made no progress (no call entered or completed, no step finished:
`comm_trace.progress`) for the time-out, typically because it waits in a collective a peer never
joins, reads every heartbeat: ranks whose heartbeat went stale are silent (stopped or dead);
the others wait in a collective or work outside one. It prints the report and exits with
HANG_EXIT_CODE; torchrun then tears the job down (or restarts it). The process group's own
time-out (`fault.collective_timeout_s`, longer) stays the backstop.

On NCCL a collective returns once queued and the host waits later (for a result it reads),
so there a stuck rank shows as outside any collective, idle since the last call it entered.

Heartbeats compare wall clocks across hosts, which NTP keeps within milliseconds of each other
(far below the seconds a heartbeat may age). If the store itself does not answer (the process
hosting it is the one stopped) the report says so and the job still ends.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megalite.comm_trace import Call, progress
from megalite.config import FaultConfig
from megalite.parallel_state import ParallelState
from megalite.training.hooks import Hook, StepRecord

HANG_EXIT_CODE = 124
"""A rank's exit status when its watchdog ended the job (as `timeout(1)` exits)."""

KEY_PREFIX = "megalite/heartbeat/"


@dataclass(frozen=True)
class Heartbeat:
    """One rank's state, as it publishes it."""

    rank: int
    step: int
    """Steps done: the rank is working on the next one."""
    blocked_in: str | None
    """The call it waits in, described; None when it is not inside one."""
    entered: str | None
    """The last call it entered, described."""
    idle_s: float
    """Seconds since it last made progress, when it wrote this."""
    wrote_at: float
    """time.time() when written."""
    host: str
    pid: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Heartbeat:
        return cls(**json.loads(text))


def current_heartbeat(rank: int, step: int) -> Heartbeat:
    """This process's heartbeat now, from the always-on record of its calls."""
    return Heartbeat(
        rank=rank,
        step=step,
        blocked_in=_describe(progress.blocked_in),
        entered=_describe(progress.entered),
        idle_s=round(progress.idle_s(), 3),
        wrote_at=time.time(),
        host=socket.gethostname(),
        pid=os.getpid(),
    )


def _describe(call: Call | None) -> str | None:
    return None if call is None else call.describe()


def _status(beat: Heartbeat) -> str:
    """What a live rank was doing when it last wrote."""
    if beat.blocked_in is not None:
        return f"waits in {beat.blocked_in} ({beat.idle_s:.1f} s)"
    return f"outside any collective for {beat.idle_s:.1f} s, the last it entered: {beat.entered}"


def hang_report(
    me: Heartbeat,
    others: dict[int, Heartbeat | None] | None,
    now: float,
    timeout_s: float,
    stale_after_s: float,
) -> str:
    """The watchdog's message: this rank's state, then the ranks that went silent (their
    heartbeat older than `stale_after_s`, or none ever), else the ranks outside any
    collective, else a hint that the ranks wait in different collectives. `others`: None when
    the store did not answer."""
    lines = [
        f"watchdog: rank {me.rank} made no progress for {me.idle_s:.1f} s "
        f"(fault.watchdog_timeout_s={timeout_s:g}) at step {me.step + 1}: {_status(me)}"
    ]
    if others is None:
        lines.append(
            "the store did not answer, so the other ranks' heartbeats are unknown: the process "
            "hosting it (rank 0, or torchrun's agent) may be the one stopped"
        )
    else:
        silent = {r: b for r, b in others.items() if b is None or now - b.wrote_at > stale_after_s}
        busy = {r: b for r, b in others.items() if r not in silent and b.blocked_in is None}
        for rank, beat in sorted(silent.items()):
            lines.append(_silent_line(rank, beat, now))
        if not silent:
            for rank, beat in sorted(busy.items()):
                lines.append(f"rank {rank} ({beat.host} pid {beat.pid}) {_status(beat)}")
        if not silent and not busy:
            lines.append(
                "every rank is alive and waits in a collective: they disagree on which one "
                "(rerun with MEGALITE_COLLECTIVE_TRACE=<dir> to record and compare them)"
            )
        waiting = len(others) - len(silent) - len(busy)
        if waiting:
            lines.append(f"{waiting} other rank(s) alive and waiting in a collective")
    lines.append(f"ending the job (exit status {HANG_EXIT_CODE})")
    return "\n".join(lines)


def _silent_line(rank: int, beat: Heartbeat | None, now: float) -> str:
    if beat is None:
        return f"rank {rank} went silent: no heartbeat from it ever arrived"
    doing = f"waiting in {beat.blocked_in}" if beat.blocked_in else "outside collectives"
    return (
        f"rank {rank} ({beat.host} pid {beat.pid}) went silent {now - beat.wrote_at:.1f} s ago; "
        f"its last heartbeat: step {beat.step + 1}, {doing}, the last collective it entered: "
        f"{beat.entered}"
    )


def collective_timeout(cfg: FaultConfig) -> float:
    """The process groups' time-out, from the config. On NCCL a collective that times out then
    tears its process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, unless set otherwise) rather than
    leaving it hung; gloo raises in the waiting call, which `comm` names."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    return cfg.collective_timeout_s


def end_job(report: str) -> None:
    """Print the report and exit at once: the training thread is stuck and cannot unwind."""
    print(report, file=sys.stderr, flush=True)
    os._exit(HANG_EXIT_CODE)


class Watchdog(Hook):
    """Two daemon threads per rank while the run trains: one publishes this rank's heartbeat,
    one ends the job once this rank made no progress for `timeout_s`. Inactive (no threads) for
    a single process or a time-out of 0. A hook: each finished step is progress."""

    def __init__(self, timeout_s: float, ps: ParallelState, step: int) -> None:
        self.timeout_s, self.step = timeout_s, step
        self.rank, self.world_size = ps.rank, ps.world_size
        self.interval_s = min(5.0, timeout_s / 5)
        """Between heartbeats and between checks."""
        self.stale_after_s = 3 * self.interval_s
        """A heartbeat older than this: its rank is silent."""
        self._stop = threading.Event()
        self._step_done = threading.Event()
        """Wakes the publisher: a heartbeat right after each step keeps the record current."""
        self._threads: list[threading.Thread] = []

    @classmethod
    def for_run(cls, cfg: FaultConfig, ps: ParallelState, step: int) -> Watchdog:
        """The run's watchdog, started when there are peers to watch and a time-out."""
        watchdog = cls(cfg.watchdog_timeout_s, ps, step)
        if ps.world_size > 1 and cfg.watchdog_timeout_s > 0:
            watchdog.start()
        return watchdog

    def start(self) -> None:
        progress.moved_on()
        default = dist.distributed_c10d._get_default_store()
        for target in (self._publish, self._watch):
            store = default.clone()  # one client per thread: a store is not shared across them
            store.set_timeout(timedelta(seconds=max(1.0, self.interval_s)))
            thread = threading.Thread(target=target, args=(store,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def after_step(self, record: StepRecord) -> None:
        self.step = record.step
        progress.moved_on()
        self._step_done.set()

    def close(self) -> None:
        self._stop.set()
        self._step_done.set()
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _publish(self, store: Any) -> None:
        key = f"{KEY_PREFIX}{self.rank}"
        while True:
            try:
                store.set(key, current_heartbeat(self.rank, self.step).to_json())
            except RuntimeError:  # the store is gone or slow: the watcher reports it
                pass
            self._step_done.wait(self.interval_s)
            self._step_done.clear()
            if self._stop.is_set():
                return

    def _watch(self, store: Any) -> None:
        while not self._stop.wait(self.interval_s):
            if progress.idle_s() > self.timeout_s:
                me = current_heartbeat(self.rank, self.step)
                others = self._read_heartbeats(store)
                end_job(hang_report(me, others, time.time(), self.timeout_s, self.stale_after_s))
                return

    def _read_heartbeats(self, store: Any) -> dict[int, Heartbeat | None] | None:
        """Every other rank's latest heartbeat (None: never written), or None when the store
        does not answer within a few heartbeat intervals."""
        found: dict[int, Heartbeat | None] = {}

        def read() -> None:
            for rank in (r for r in range(self.world_size) if r != self.rank):
                key = f"{KEY_PREFIX}{rank}"
                found[rank] = Heartbeat.from_json(store.get(key)) if store.check([key]) else None

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=max(3.0, 3 * self.interval_s))
        return None if reader.is_alive() or len(found) < self.world_size - 1 else found
