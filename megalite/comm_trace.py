"""A record of every collective and point-to-point message each rank issues, and the check that
ranks agree on it.

Every rank of a group must run the same collectives in the same order with the same dtype and
element count, and a send must meet a receive of the same size (docs/architecture.md, the
equivalence principle). When they do not, gloo aborts with "Received data size doesn't match",
and NCCL hangs or silently corrupts memory. Neither names the call that diverged.

With `MEGALITE_COLLECTIVE_TRACE=<dir>` set (the multi-process tests always set it), `comm.py`
appends one line per call to `<dir>/rank<N>.trace` *before* issuing it, so the record survives a
rank that aborts inside the call. `check_traces(dir)` then compares the ranks' records and names
the first call on which the members of a group disagree.

Both are `CommObserver`s, the one way anything watches communication: `comm` tells every
registered observer of each call as it is entered, while the rank is blocked in it, when an
asynchronous one is issued, and around its layout copies. Always registered: `trace_file` (the
record above, when the variable is set) and `progress` (cheap: no formatting, no I/O), which
keeps the last call this rank entered, the call it is blocked in, and when it last moved on;
the watchdog (`training/watchdog.py`) publishes it and reads it to name a hang, and a call that
fails is named from it (`CollectiveError`). Byte counts (`comm.record_collectives`) and the
profiler's timer (`profiling/step_timing.CommTimer`) are observers registered for a while.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

ENV = "MEGALITE_COLLECTIVE_TRACE"


class CollectiveMismatch(AssertionError):
    """Ranks of one group issued different collectives, or a send met a different receive."""


class _Trace:
    """This process's open trace file; reopened after a fork or a change of rank."""

    def __init__(self) -> None:
        self.file: TextIO | None = None
        self.key: tuple[str, int, int] | None = None
        self.group_ranks: dict[int, str] = {}

    def writer(self) -> TextIO | None:
        directory = os.environ.get(ENV)
        if not directory or not dist.is_initialized():
            return None
        key = (directory, os.getpid(), dist.get_rank())
        if key != self.key:
            path = Path(directory) / f"rank{dist.get_rank()}.trace"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # line-buffered: each call hits the file
            self.key, self.group_ranks = key, {}
        return self.file

    def ranks_of(self, group: Any) -> str:
        """The group's global ranks, 'r0,r1,...': the same string on every member."""
        group = dist.group.WORLD if group is None else group
        if id(group) not in self.group_ranks:
            ranks = dist.get_process_group_ranks(group)
            self.group_ranks[id(group)] = ",".join(map(str, ranks))
        return self.group_ranks[id(group)]

    def name_of(self, group: Any) -> str:
        """The group's purpose and ranks, 'pp@0,2': two groups of the same ranks (a purpose
        each, `parallel_state`) are two streams whose calls interleave freely."""
        group = dist.group.WORLD if group is None else group
        return f"{group.group_desc}@{self.ranks_of(group)}"


_trace = _Trace()


def _dtype_x_count(dtype: torch.dtype, numel: int) -> str:
    return f"{str(dtype).removeprefix('torch.')}x{numel}"


class CollectiveError(RuntimeError):
    """A collective or p2p message failed (a time-out, a peer that died): torch's error, with the
    rank and the call it failed in named. Not a user error: its traceback is shown."""


@dataclass(frozen=True)
class Call:
    """One collective or p2p message, as the in-memory record keeps it (no formatting until
    someone asks: `describe`)."""

    number: int
    """This rank's count of calls so far, this one included."""
    op: str
    group: Any
    """The process group (None: the world); for p2p, the group it is posted on."""
    dtype: torch.dtype | None
    numel: int
    peer: int | None = None
    """The other end of a p2p message (global rank)."""

    def describe(self) -> str:
        """e.g. 'all_reduce over ranks 0,1 (float32x4, call #57)'."""
        where = f"with rank {self.peer}" if self.peer is not None else f"over ranks {self.ranks()}"
        shape = "-" if self.dtype is None else _dtype_x_count(self.dtype, self.numel)
        return f"{self.op} {where} ({shape}, call #{self.number})"

    def ranks(self) -> str:
        return _trace.ranks_of(self.group) if dist.is_initialized() else "?"


class CommObserver:
    """Sees every collective and p2p message of this process (registered with `comm.observe`,
    or always: `progress`, `trace_file`); a subclass overrides what it needs. Calls are told
    apart by `Call.group` (the axis) and `Call.peer` (p2p)."""

    def entered(self, call: Call) -> None:
        """`call` is about to be issued."""

    def blocking(self, call: Call) -> contextlib.AbstractContextManager[None]:
        """Around each time the rank is blocked in `call`: a blocking call, the issue of an
        asynchronous one, and the wait for it (the same `Call` object)."""
        return contextlib.nullcontext()

    def started(self, call: Call, work: Any) -> None:
        """An asynchronous collective was issued; `work` is the backend's handle."""

    def layout_copy(self) -> contextlib.AbstractContextManager[None]:
        """Around a copy that moves a dim-wise collective's tensor to or from dim 0."""
        return contextlib.nullcontext()


class Progress(CommObserver):
    """This process's last call entered, the call it is blocked in (None when it is not), and
    when it last moved on (time.monotonic()). Written by the training thread (and a checkpoint
    writer's thread, `moved_on`); read by the watchdog's threads (single attribute reads and
    writes: no lock needed)."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered_call: Call | None = None
        self.blocked_in: Call | None = None
        self.moved_at = time.monotonic()

    def entered(self, call: Call) -> None:
        self.entered_call, self.moved_at = call, time.monotonic()

    def moved_on(self) -> None:
        """Progress that is no collective (a finished step, a piece of a checkpoint written)."""
        self.moved_at = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since this process last entered or finished a call or a step."""
        return time.monotonic() - self.moved_at

    @contextlib.contextmanager
    def blocking(self, call: Call) -> Iterator[None]:
        """Marks this process as blocked in `call`, and names it (and this rank) when it
        fails (the outermost observer: it sees every error raised inside)."""
        self.blocked_in = call
        try:
            yield
        except RuntimeError as error:  # torch.distributed's errors (time-outs, closed peers)
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise CollectiveError(f"rank {rank}: {call.describe()} failed: {error}") from error
        finally:
            self.blocked_in = None
            self.moved_at = time.monotonic()


class TraceFile(CommObserver):
    """Writes each call to `<MEGALITE_COLLECTIVE_TRACE>/rank<N>.trace` before it is issued."""

    def entered(self, call: Call) -> None:
        writer = _trace.writer()
        if writer is None:
            return
        shape = "-" if call.dtype is None else _dtype_x_count(call.dtype, call.numel)
        if call.peer is None:
            writer.write(f"group {_trace.name_of(call.group)} {call.op} {shape}\n")
        else:
            purpose = _trace.name_of(call.group).partition("@")[0]
            writer.write(f"{call.op} {purpose}@{call.peer} {shape}\n")


progress = Progress()
trace_file = TraceFile()


def new_call(op: str, tensor: torch.Tensor | None, group: Any, peer: int | None = None) -> Call:
    """The record of this rank's next call: a collective over `group` on the tensor every
    member passes with equal size, or (peer given) a send or receive."""
    progress.calls += 1
    dtype, numel = (None, 0) if tensor is None else (tensor.dtype, tensor.numel())
    return Call(progress.calls, op, group, dtype, numel, peer)


def _read(directory: Path) -> dict[int, list[str]]:
    traces = {}
    for path in directory.glob("rank*.trace"):
        traces[int(path.stem.removeprefix("rank"))] = path.read_text().splitlines()
    return traces


def _sequences(traces: dict[int, list[str]]) -> dict[str, dict[int, list[str]]]:
    """Stream name -> {rank: its calls in order}. A group's stream holds its collectives; the
    stream 'p2p pp a->b' holds a's sends to b on the pp group and b's receives from a there.
    A name is `purpose@ranks` (`purpose@peer` for p2p); the purpose may be absent."""
    streams: dict[str, dict[int, list[str]]] = {}
    for rank, lines in traces.items():
        for line in lines:
            kind, who, call = line.split(" ", 2)
            purpose, _, who = who.rpartition("@")
            on = f"{purpose}@" if purpose else ""
            if kind == "group":
                name, members = f"group {on}{who}", map(int, who.split(","))
            else:
                src, dst = (rank, int(who)) if kind == "send" else (int(who), rank)
                name, members = f"p2p {on}{src}->{dst}", (src, dst)
            stream = streams.setdefault(name, {member: [] for member in members})
            stream[rank].append(call)
    return streams


def check_traces(directory: Path, complete: bool = True) -> None:
    """Raise CollectiveMismatch naming the first call on which two members of a group (or the
    two ends of a p2p link) disagree, with the calls of every member at that position.

    `complete=False` when some rank stopped early (an error, a time-out): its record is then
    shorter for that reason alone, so only the calls that every member made are compared."""
    for name, calls in sorted(_sequences(_read(Path(directory))).items()):
        length = max(len(seq) for seq in calls.values())
        compared = length if complete else min(len(seq) for seq in calls.values())
        for index in range(compared):
            at = {
                rank: seq[index] if index < len(seq) else "(nothing)" for rank, seq in calls.items()
            }
            if len(set(at.values())) > 1:
                detail = "; ".join(f"rank {rank}: {call}" for rank, call in sorted(at.items()))
                raise CollectiveMismatch(
                    f"ranks disagree on call #{index} of {name} (of {length}): {detail}. A "
                    "collective's count and size must depend only on quantities equal across "
                    "its group"
                )
