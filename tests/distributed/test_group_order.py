"""One communicator per purpose: under NCCL's rule that a group's operations run in issue order
(`megalite.nccl_contract`, item 10, emulated by `megalite.testing.nccl_like`), a ring-attention
step must not queue behind a pipeline send or a ZeRO gather that it does not need.

Each case runs the trainer's own calls (the ring's `pass_on` on the cp group, the executor's
`post_p2p` on the pp group, the grad buffer's asynchronous `all_gather_flat` on the ZeRO group)
in `build_parallel_state`'s groups, then again in the groups megalite had before (p2p on the
world's communicator, the ZeRO group the cp group when their ranks coincide), and reads what
the emulation recorded as queued behind what. The record does not depend on timing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megalite import comm
from megalite.context_parallel.attention import _Ring
from megalite.launch import run_ranks
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.testing import nccl_like

CPU = torch.device("cpu")


def _shared(ps: ParallelState, **shared: object) -> ParallelState:
    """`ps` with some purposes' groups replaced, as the old grouping had them."""
    return dataclasses.replace(ps, groups={**ps.groups, **shared})


def _ring_step(ps: ParallelState) -> None:
    kv = torch.full((2, 1, 4, 1, 8), float(ps.rank))  # (k/v, b, rows, heads, head dim)
    pending, received = _Ring(ps.ranks("cp"), ps.coord("cp"), ps.group("cp")).pass_on(kv)
    pending.wait()
    assert (received == ps.ranks("cp")[(ps.coord("cp") - 1) % ps.size("cp")]).all()


def _ring_after_a_pipeline_send(shared: bool) -> list[tuple[str, str, str]]:
    """cp 2 x pp 2: the first stage sends an activation on; the last stage posts its receive only
    after its own ring step. In between, every rank runs one ring step."""
    emulation = nccl_like.install()
    ps = build_parallel_state(tp=1, pp=2, device=CPU, cp=2)
    if shared:
        ps = _shared(ps, pp=dist.group.WORLD, cp=dist.group.WORLD)
    activation = torch.ones(3)
    if ps.coord("pp") == 0:
        send = comm.post_p2p([(activation, ps.ranks("pp")[1])], [], ps.group("pp"))
        _ring_step(ps)
        send.wait()
    else:
        _ring_step(ps)
        comm.post_p2p([], [(torch.empty(3), ps.ranks("pp")[0])], ps.group("pp")).wait()
    return [dataclasses.astuple(held) for held in emulation.held]


def _ring_after_a_zero_gather(shared: bool) -> list[tuple[str, str, str]]:
    """cp 2 alone, so the ZeRO group (dp x cp) has the cp group's ranks: a bucket's parameter
    gather is in flight while the next layer's ring step runs."""
    emulation = nccl_like.install()
    ps = build_parallel_state(tp=1, pp=1, device=CPU, cp=2)
    if shared:
        ps = _shared(ps, dp_cp=ps.group("cp"))
    shard = torch.full((4,), float(ps.rank))
    full = torch.empty(4 * ps.size("dp", "cp"))
    gather = comm.all_gather_flat(full, shard, ps.group("dp", "cp"), async_op=True)
    _ring_step(ps)
    gather.wait()
    assert full.tolist() == [0.0] * 4 + [1.0] * 4
    return [dataclasses.astuple(held) for held in emulation.held]


PIPELINE = ("default_pg", "recv", "send")
"""A ring step (its batch's last op, a receive) on the world's group, behind a pipeline send."""
ZERO = ("cp", "recv", "all_gather")
"""A ring step behind a ZeRO gather, on the one group both had."""


@pytest.mark.parametrize(
    "case,queued_when_shared",
    [
        (_ring_after_a_pipeline_send, [[PIPELINE], [PIPELINE], [], []]),  # the first stage's
        (_ring_after_a_zero_gather, [[ZERO], [ZERO]]),
    ],
    ids=["pipeline-send", "zero-gather"],
)
def test_a_ring_step_waits_for_nothing_of_another_purpose(case, queued_when_shared):
    """With a group per purpose nothing queues behind anything; with the old grouping the ring
    step queues behind the other traffic on every rank that issued that first."""
    world = len(queued_when_shared)
    assert run_ranks(world, case, False, timeout=120) == [[]] * world
    assert run_ranks(world, case, True, timeout=120) == queued_when_shared
