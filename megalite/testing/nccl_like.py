"""gloo made to run communication as NCCL does (`megalite.nccl_contract`), through megalite's
own code: `comm` hands the emulation every call on a gloo group (`comm.set_emulation`).

- **One work per p2p batch, sends that complete only when matched** (items 1 and 2): a batch
  returns one work, done once every send has met its receive; what it received lands in the
  buffers only when the work is seen complete, NaN until then.
- **A group's operations complete in the order they were issued** (item 10): NCCL runs one
  group's collectives and p2p batches in issue order on one stream, so waiting on one waits on
  every earlier one of that group. The emulation finishes a group's outstanding operation
  before it issues the group's next (the host waits where NCCL's stream would: at least as
  strict), and records each time a call had to wait for an earlier one it was issued after
  (`held`), whether or not the earlier one had finished by then. A test reads that record to
  see which traffic queues behind which: the record is the same whatever the timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megalite.comm_trace import Call

_HANDSHAKE_TAG = 1  # the program's own messages use tag 0


@dataclass(frozen=True)
class Held:
    """`call` was issued on `group` while `behind`, issued before it on the same group, was
    still outstanding: on NCCL `call` could not start before `behind` ended."""

    group: str
    call: str
    behind: str


class _InOrder:
    """A work of the emulation: outstanding on its group until waited for, once."""

    def __init__(self, work: Any, call: Call, queue: list[_InOrder]) -> None:
        self.work, self.call, self.queue = work, call, queue
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.done = True
            if self.work is not None:
                self.work.wait()
            self.queue.remove(self)
        return True

    def is_completed(self) -> bool:
        if not self.done and (self.work is None or self.work.is_completed()):
            self.wait()
        return self.done


class _CoalescedBatch:
    """NCCL's one work for a p2p batch: sends done once matched (each waits for its receiver's
    handshake), receives landing in their buffers once the batch is seen complete. It holds the
    batch's tensors, as NCCL's work stashes them (item 7)."""

    def __init__(
        self,
        works: list[Any],
        landing: list[tuple[torch.Tensor, torch.Tensor]],
        tensors: list[torch.Tensor],
    ) -> None:
        self.works, self.landing, self.tensors = works, landing, tensors

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for buffer, received in self.landing:
            buffer.copy_(received)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


@dataclass
class NcclLike:
    """The emulation (`comm.set_emulation(NcclLike())`); one per process."""

    held: list[Held] = field(default_factory=list)
    """Every time a call had to wait for an earlier one of its group, in order."""
    _outstanding: dict[int, list[_InOrder]] = field(default_factory=dict)

    def applies(self, group: Any) -> bool:
        """gloo only: an NCCL group is NCCL itself."""
        return dist.get_backend(group) == "gloo"

    def issue(self, call: Call, issue: Callable[[bool], Any], async_op: bool) -> Any:
        """Run `issue(async_op)` once every earlier operation of `call`'s group has ended; an
        asynchronous one stays outstanding on its group until waited for."""
        queue = self._queue(call)
        work = issue(async_op)
        return self._outstanding_on(queue, work, call) if async_op else work

    def batch_isend_irecv(self, ops: list[dist.P2POp], call: Call) -> list[_InOrder]:
        """`dist.batch_isend_irecv` as NCCL runs it: one work for the batch (item 1), whose
        sends complete only when matched (item 2), after the group's earlier operations."""
        queue = self._queue(call)
        works, landing = [], []
        for op in ops:
            group, peer = op.group, op.group_peer
            if op.op is dist.isend:
                works.append(dist.isend(op.tensor, group=group, group_dst=peer))
                hello = torch.empty(1)
                works.append(dist.irecv(hello, group=group, group_src=peer, tag=_HANDSHAKE_TAG))
            else:
                received = torch.empty_like(op.tensor)
                landing.append((op.tensor, received))
                works.append(dist.irecv(received, group=group, group_src=peer))
                hello = torch.ones(1)
                works.append(dist.isend(hello, group=group, group_dst=peer, tag=_HANDSHAKE_TAG))
        for buffer, _ in landing:
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
        batch = _CoalescedBatch(works, landing, [op.tensor for op in ops])
        return [self._outstanding_on(queue, batch, call)]

    def _queue(self, call: Call) -> list[_InOrder]:
        """`call`'s group's outstanding operations, once each has ended (each that was still
        outstanding is recorded in `held`)."""
        queue = self._outstanding.setdefault(id(call.group), [])
        for earlier in list(queue):
            name = getattr(call.group, "group_desc", "?")
            self.held.append(Held(name, call.op, earlier.call.op))
            earlier.wait()
        return queue

    def _outstanding_on(self, queue: list[_InOrder], work: Any, call: Call) -> _InOrder:
        handle = _InOrder(work, call, queue)
        queue.append(handle)
        return handle


def install() -> NcclLike:
    """Emulate NCCL in this process and those it forks from now on; returns the emulation.
    (`comm` is imported here, not at the top: a subprocess's hook installs the emulation as
    `comm` loads, and `comm` must not load while this module does.)"""
    from megalite import comm

    emulation = NcclLike()
    comm.set_emulation(emulation)
    return emulation


def uninstall() -> None:
    """gloo's own behaviour again."""
    from megalite import comm

    comm.set_emulation(None)
