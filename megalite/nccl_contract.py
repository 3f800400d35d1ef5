"""Where NCCL differs from gloo, as torch 2.13's own source has it, and how the test mode makes
gloo behave like NCCL through the same megalite code (`comm` calls `batch_isend_irecv` here
where it would call torch's).

The contract megalite relies on (distributed_c10d.py, ProcessGroupNCCL):

1. `batch_isend_irecv` returns ONE work for the whole batch on NCCL: a backend that supports
   coalescing runs the ops inside `_coalescing_manager(group, device, async_ops=True)` and returns
   `cm.works`, the single work of `_end_coalescing`. gloo returns one work per op. megalite treats
   a batch as done when every handle it returned is (`comm.P2PBatch`), so either shape works.
2. Sends block: NCCL runs a batch as one grouped kernel that ends when every send has met its
   receive, and a rank's batches run one after another on one stream. On gloo a send's `wait()`
   also blocks until the receiver posts, but only posting is ordered: a rank's batches run side
   by side, so a batching that deadlocks on one stream can run there. The emulation completes a
   send only once its receiver has posted the receive, and completes each batch before the next
   starts (the host waits where NCCL's stream would: at least as strict).
3. `wait()` on NCCL makes the current CUDA stream wait for the work; the host goes on. A received
   tensor may be read on the host only after a synchronising call (`.item()`, `.cpu()`), and step
   timers must be CUDA events, not the host clock (`executor.IntervalTimer`). On gloo (CPU) wait
   blocks the host, which is stricter.
4. Time-outs are per group: `new_group` without `timeout` takes the backend's default (NCCL 10
   min, gloo 30 min), not the world's. `parallel_state` passes the configured one to every group.
5. A batched p2p uses the group's own communicator (`getKeyFromDevice` while NCCL's group is
   open), and a communicator that does not exist yet is created by the first operation on it,
   a step every rank of the group must take (torch's docstring: "if this API is the first
   collective call in the group ... all ranks of the group must participate"). megalite binds
   the device on CUDA (item 8): the world communicator is connected in `init_process_group` and
   every subgroup's is split from it (`split_group`), so no first operation creates one. gloo
   connects every group when it is made, which is what the test mode then matches.
6. Contiguity differs: NCCL's collectives refuse a strided tensor ("Tensors must be
   contiguous") and its p2p only warns and sends the raw memory; gloo's `all_reduce` of a
   strided view silently reduces the first numel elements of its storage, its
   `all_gather_into_tensor` / `reduce_scatter_tensor` accept one, its all-to-all and p2p refuse.
   So `comm` refuses a strided tensor on every backend (`comm.all_reduce`, `post_p2p`, ...);
   callers make messages contiguous (`executor._post`) or hand strided pieces to the calls that
   copy them (`comm._reduce_scatter`). `all_gather_into_tensor` / `reduce_scatter_tensor` need
   output = group size x input on both; megalite sizes collectives by global shapes only.
7. Tensor stashing: NCCL keeps every tensor of an asynchronous op alive until the op completes
   (its work stashes them and records the stream), as gloo's work does; so the executor may drop
   its own reference to a sent activation as soon as the send is posted.
8. `device_id` in `init_process_group` binds the device and connects NCCL eagerly; a subgroup
   made by `new_group` is then split from the world communicator (`ncclCommSplit`), a step every
   world rank takes, members or not (non-members make a no-colour split): one world-wide split
   per group. Without it, each communicator bootstraps through the store on its first
   collective, inside step 1. `parallel_state` binds the device on CUDA and splits each axis's
   groups with one `split_group` call (5 calls where `new_group` would make 464 at 1,024 ranks).
9. `use_local_synchronization=True` lets non-members skip `new_group`, but with a bound device
   they then skip their part of the split and the members hang; on gloo torch names such groups
   by a hash that depends on how many groups each process already made. megalite never uses it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

NCCL_LIKE_P2P_ENV = "MEGALITE_NCCL_LIKE_P2P"
"""Set to 1 (the test suite does) for gloo p2p with NCCL's semantics (items 1 and 2)."""

_HANDSHAKE_TAG = 1  # the program's own messages use tag 0


def enabled(group: Any = None) -> bool:
    """Whether p2p on `group` runs under the emulation: asked for, and on gloo (an NCCL group
    is NCCL itself)."""
    return os.environ.get(NCCL_LIKE_P2P_ENV) == "1" and dist.get_backend(group) == "gloo"


class CoalescedWork:
    """NCCL's coalesced work for one batch. The batch ran to its end before the emulation
    returned it (as NCCL's stream would before the next one), but what it received lands in the
    receive buffers only once the work is seen complete (`wait`, or `is_completed` saying so):
    until then they hold NaN, as an NCCL buffer holds whatever it held before the kernel wrote
    it, so a read that skips the wait shows. It holds the batch's tensors, as NCCL's work
    stashes them (item 7)."""

    def __init__(
        self, tensors: list[torch.Tensor], landing: list[tuple[torch.Tensor, torch.Tensor]]
    ):
        self.tensors, self.landing = tensors, landing

    def wait(self, timeout: Any = None) -> bool:
        for buffer, received in self.landing:
            buffer.copy_(received)
        self.landing = []
        return True

    def is_completed(self) -> bool:
        return self.wait()


def batch_isend_irecv(ops: list[dist.P2POp]) -> list[CoalescedWork]:
    """`dist.batch_isend_irecv` as NCCL runs it, on gloo: one work for the batch (item 1), sends
    that complete only when matched and a batch that ends before the next begins (item 2)."""
    group = ops[0].group
    works, announced, landing = [], [], []
    for op in ops:
        if op.op is dist.isend:
            works.append(dist.isend(op.tensor, op.peer, group=group))
            announced.append(dist.irecv(torch.empty(1), op.peer, group=group, tag=_HANDSHAKE_TAG))
        else:
            received = torch.empty_like(op.tensor)
            landing.append((op.tensor, received))
            works.append(dist.irecv(received, op.peer, group=group))
            announced.append(dist.isend(torch.ones(1), op.peer, group=group, tag=_HANDSHAKE_TAG))
    for work in works + announced:
        work.wait()
    for buffer, _ in landing:
        if buffer.is_floating_point():
            buffer.fill_(float("nan"))
    return [CoalescedWork([op.tensor for op in ops], landing)]
