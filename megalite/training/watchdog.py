"""The step watchdog: a rank that stops making progress ends the job within
`fault.watchdog_timeout_s`, with a message naming the rank that went silent, its step and the
last collective it entered, instead of hanging until the collective time-out (or for ever).

Which rank detects what. A rank stopped outright (SIGSTOP, a frozen node) cannot speak, so its
peers speak for it. Every rank publishes a heartbeat to the job's store (torch.distributed's
default TCPStore) a few times per time-out: its step, the call it is blocked in, the last call
it entered, how long it has been idle, and the wall-clock time it wrote. A rank whose training
thread has made no progress (no call entered or completed, no step finished, no piece of a
checkpoint written: `comm_trace.progress`) for the time-out, typically because it waits in a
collective a peer never joins, reads every heartbeat: ranks whose heartbeat went stale are
silent (stopped or dead); the others wait in a collective or work outside one. It prints the
report and exits with HANG_EXIT_CODE; torchrun then tears the job down (or restarts it). The
process group's own time-out (`fault.collective_timeout_s`, longer) stays the backstop.

On NCCL a collective returns once queued and the host waits later (for a result it reads),
so there a stuck rank shows as outside any collective, idle since the last call it entered.

Heartbeats compare wall clocks across hosts, which NTP keeps within milliseconds of each other
(far below the seconds a heartbeat may age). If the store itself does not answer (the process
hosting it is the one stopped) the report says so and the job still ends.

At scale. Every blocked rank detects the hang at about the same moment, and one store serves
them all, so reading is kept to O(W) requests for the whole job, not per rank: the first rank to
detect (elected by one `add` on the store) reads all W heartbeats in one `multi_get` and prints
the report; every other detecting rank prints one line about itself and reads only its own
node's heartbeats (one `multi_get`). Each detecting rank then SIGKILLs the silent ranks on its
host (its siblings under the same torchrun agent, by the pid in their heartbeat): a stopped
process ignores the agent's SIGTERM, and the agent waits 30 s (hard-coded in torch 2.13's
`LocalElasticAgent._stop_workers`; `--shutdown-timeout` only applies when torchrun itself is
signalled) before its SIGKILL. A silent rank alone on its node has no local watchdog: its agent
sees no failure and the job ends when the others' agents leave the rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megalite.comm_trace import Call, progress
from megalite.config import FaultConfig
from megalite.parallel_state import ParallelState
from megalite.training.hooks import Hook, StepRecord

HANG_EXIT_CODE = 124
"""A rank's exit status when its watchdog ended the job (as `timeout(1)` exits)."""

KEY_PREFIX = "megalite/heartbeat/"
REPORTER_KEY = "megalite/hang/reporters"
"""Counts the ranks whose watchdog fired: the first is the one that reads every heartbeat."""
MAX_LISTED = 8
"""Ranks named one per line in a report; the rest are counted (a report at 1,024 ranks stays
short)."""


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
        entered=_describe(progress.entered_call),
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
    collective, else this rank itself when only it is outside one (its peers wait for it),
    else a hint that the ranks wait in different collectives. `others`: None when
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
        lines += _listed(sorted(silent.items()), lambda r, b: _silent_line(r, b, now), "silent")
        if not silent:
            lines += _listed(sorted(busy.items()), _busy_line, "outside any collective")
        if not silent and not busy and me.blocked_in is None:
            # the reporter is the first to time out: the rank whose own work stopped
            lines.append(
                f"rank {me.rank} (this one) is the only rank outside a collective, and the "
                "others wait for it: its work outside the collectives stopped (I/O, a lock, a "
                "loop; its stack below shows where)"
            )
        elif not silent and not busy:
            lines.append(
                "every rank is alive and waits in a collective: they disagree on which one "
                "(rerun with MEGALITE_COLLECTIVE_TRACE=<dir> to record and compare them)"
            )
        waiting = len(others) - len(silent) - len(busy)
        if waiting:
            lines.append(f"{waiting} other rank(s) alive and waiting in a collective")
    lines.append(f"ending the job (exit status {HANG_EXIT_CODE})")
    return "\n".join(lines)


def _listed(items: list[tuple[int, Any]], line: Any, what: str) -> list[str]:
    """One line per rank up to MAX_LISTED, then how many more there are."""
    lines = [line(rank, beat) for rank, beat in items[:MAX_LISTED]]
    if len(items) > MAX_LISTED:
        lines.append(f"... and {len(items) - MAX_LISTED} more rank(s) {what}")
    return lines


def _busy_line(rank: int, beat: Heartbeat) -> str:
    return f"rank {rank} ({beat.host} pid {beat.pid}) {_status(beat)}"


def detector_line(me: Heartbeat, timeout_s: float) -> str:
    """What a rank that detected the hang but is not the reporter prints: itself, in one line."""
    return (
        f"watchdog: rank {me.rank} made no progress for {me.idle_s:.1f} s "
        f"(fault.watchdog_timeout_s={timeout_s:g}) at step {me.step + 1}: {_status(me)}; "
        f"the first rank to detect names the silent rank(s); exit status {HANG_EXIT_CODE}"
    )


def heartbeat_key(rank: int) -> str:
    return f"{KEY_PREFIX}{rank}"


def read_heartbeats(store: Any, ranks: list[int]) -> dict[int, Heartbeat | None]:
    """The latest heartbeat of each of `ranks` (None: never written), in batched requests: one
    `check` and one `multi_get` when all exist (multi_get waits for a missing key, so the
    missing ones are found by halving: about 2 log2(len(ranks)) requests more per missing rank)."""
    found: dict[int, Heartbeat | None] = {}
    pending = [list(ranks)] if ranks else []
    while pending:
        part = pending.pop()
        keys = [heartbeat_key(r) for r in part]
        if store.check(keys):
            found.update(zip(part, map(Heartbeat.from_json, store.multi_get(keys))))
        elif len(part) == 1:
            found[part[0]] = None
        else:
            pending += [part[: len(part) // 2], part[len(part) // 2 :]]
    return found


def is_reporter(store: Any) -> bool:
    """Whether this rank is the first whose watchdog fired (one `add` on the store)."""
    return store.add(REPORTER_KEY, 1) == 1


def node_ranks(rank: int) -> list[int]:
    """The global ranks torchrun's agent started on this node (it numbers them contiguously);
    just this rank outside torchrun."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return list(range(rank - local_rank, rank - local_rank + local_world_size))


def kill_silent_siblings(
    beats: dict[int, Heartbeat | None], now: float, stale_after_s: float
) -> list[str]:
    """SIGKILL the ranks whose heartbeat went stale and that run on this host as children of
    this process's parent (the same torchrun agent or test launcher); one line for each."""
    host, killed = socket.gethostname(), []
    for rank, beat in sorted(beats.items()):
        if beat is None or now - beat.wrote_at <= stale_after_s or beat.host != host:
            continue
        if beat.pid == os.getpid() or _parent_pid(beat.pid) != os.getppid():
            continue
        try:
            os.kill(beat.pid, signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours after all
            continue
        killed.append(f"killed rank {rank} (pid {beat.pid}), silent on this host, to end the job")
    return killed


def _parent_pid(pid: int) -> int | None:
    """The parent of `pid` (Linux /proc), None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name, in parentheses, may hold spaces


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
        key = heartbeat_key(self.rank)
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
                end_job(self.report(store))
                return

    def report(self, store: Any) -> str:
        """The hang report (from the reporter) or this rank's line, after killing the silent
        ranks on this host. The store is given a few heartbeat intervals to answer."""
        me = current_heartbeat(self.rank, self.step)
        read: dict[str, Any] = {}

        def elect_and_read() -> None:
            with contextlib.suppress(RuntimeError):  # the store is gone: reported as such
                reporter = is_reporter(store)
                ranks = range(self.world_size) if reporter else node_ranks(self.rank)
                others = read_heartbeats(store, [r for r in ranks if r != self.rank])
                read.update(reporter=reporter, beats=others)

        reader = threading.Thread(target=elect_and_read, daemon=True)
        reader.start()
        reader.join(timeout=max(3.0, 3 * self.interval_s))
        now = time.time()
        beats = None if reader.is_alive() else read.get("beats")
        killed = kill_silent_siblings(beats or {}, now, self.stale_after_s)
        if beats is not None and not read["reporter"]:
            return "\n".join([detector_line(me, self.timeout_s), *killed])
        # stuck outside the collectives, the reporter says where (inside one, the call is named)
        stack = [] if me.blocked_in is not None else training_stack()
        lines = hang_report(me, beats, now, self.timeout_s, self.stale_after_s).splitlines()
        return "\n".join([*lines[:-1], *stack, *killed, lines[-1]])


def training_stack(frames: int = 12) -> list[str]:
    """Where the training (main) thread is now, its innermost `frames` calls, as lines."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    calls = "".join(traceback.format_stack(frame)[-frames:]).rstrip().splitlines()
    return ["the training thread's stack, innermost call last:", *calls]
