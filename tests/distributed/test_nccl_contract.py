"""The NCCL contract as the test mode emulates it (`megalite.testing.nccl_like`, installed for
the whole suite by conftest.py): one work per batch, sends that complete only when matched, a
group's operations in issue order; megalite's p2p correct for either return shape."""

import time

import pytest
import torch
import torch.distributed as dist

from megalite import comm
from megalite.launch import run_ranks
from megalite.testing import nccl_like


def _as(nccl: bool) -> None:
    """This rank runs under the emulation or gloo as it is."""
    if nccl:
        nccl_like.install()
    else:
        nccl_like.uninstall()


def _batch_shapes(nccl: bool) -> tuple[int, bool]:
    """Rank 0 sends one tensor and receives another from rank 1 in one batch, rank 1 the other
    way round: how many works the backend returned, and whether the received values arrived."""
    _as(nccl)
    rank = dist.get_rank()
    received = torch.empty(4)
    batch = comm.post_p2p(
        [(torch.full((4,), float(rank)), 1 - rank)], [(received, 1 - rank)], dist.group.WORLD
    )
    works = len(batch.works)
    batch.wait()
    return works, bool((received == 1 - rank).all())


@pytest.mark.parametrize("nccl,works", [(True, 1), (False, 2)], ids=["nccl", "gloo"])
def test_a_batch_returns_what_its_backend_returns(nccl, works):
    """NCCL coalesces a batch into one work (`cm.works` in torch's batch_isend_irecv); gloo
    returns one per op."""
    assert run_ranks(2, _batch_shapes, nccl, timeout=60) == [(works, True)] * 2


def _time_to_post_behind_a_send(nccl: bool, receiver_delay_s: float) -> float:
    """Seconds rank 0's second batch on the world's group takes to post while its first, a lone
    send, waits for rank 1, which posts both receives late."""
    _as(nccl)
    comm.barrier()
    world = dist.group.WORLD
    if dist.get_rank() == 1:
        time.sleep(receiver_delay_s)
        batches = [comm.post_p2p([], [(torch.empty(1024), 0)], world) for _ in range(2)]
        posted = 0.0
    else:
        batches = [comm.post_p2p([(torch.ones(1024), 1)], [], world)]
        start = time.perf_counter()
        batches.append(comm.post_p2p([(torch.ones(1024), 1)], [], world))
        posted = time.perf_counter() - start
    for batch in batches:
        batch.wait()
    return posted


@pytest.mark.serial
def test_a_groups_next_operation_starts_when_its_send_is_matched():
    """Under NCCL a send ends only when the receiver reaches the receive, and the group's next
    operation only after that; gloo posts both at once. (The pipeline tests run every schedule
    under this rule, where a receive posted too late deadlocks.)"""
    delay = 1.0
    nccl = run_ranks(2, _time_to_post_behind_a_send, True, delay, timeout=60)[0]
    gloo = run_ranks(2, _time_to_post_behind_a_send, False, delay, timeout=60)[0]
    assert nccl >= 0.8 * delay
    assert gloo < 0.5 * delay


def _executor_style_batches(nccl: bool) -> list[float]:
    """comm.post_p2p as the pipeline executor uses it: a batch that sends before it receives,
    its receive waited for through the batch's handle, whatever shape the backend returned."""
    _as(nccl)
    comm.barrier()
    rank, got = dist.get_rank(), []
    for step in range(3):
        buffer = torch.empty(8)
        message = torch.full((8,), 10.0 * step + rank)
        batch = comm.post_p2p([(message, 1 - rank)], [(buffer, 1 - rank)], dist.group.WORLD)
        batch.wait()
        batch.wait()  # a second wait is harmless (gloo hangs on waiting a work twice)
        assert batch.is_completed()
        got.append(buffer[0].item())
    return got


@pytest.mark.parametrize("nccl", [True, False], ids=["nccl", "gloo"])
def test_post_p2p_receives_are_ready_after_the_batch(nccl):
    assert run_ranks(2, _executor_style_batches, nccl, timeout=60) == [
        [1.0, 11.0, 21.0],
        [0.0, 10.0, 20.0],
    ]


def _received_before_and_after_the_wait() -> tuple[bool, bool]:
    """Each rank receives the other's ones through `comm.post_p2p` under the emulation."""
    rank = dist.get_rank()
    received = torch.zeros(4)
    batch = comm.post_p2p([(torch.ones(4), 1 - rank)], [(received, 1 - rank)], dist.group.WORLD)
    before = bool(received.isnan().all())
    batch.wait()
    return before, bool((received == 1).all())


def test_a_receive_lands_only_when_its_work_is_seen_complete():
    """On NCCL a receive buffer holds its old contents until the work completes; the emulation
    holds NaN there until the work is waited on (or polled complete), so a read that skips
    the wait fails a test here rather than a run on GPUs."""
    assert run_ranks(2, _received_before_and_after_the_wait, timeout=60) == [(True, True)] * 2


def _reduce_a_strided_view() -> str:
    column = torch.arange(12.0).view(3, 4)[:, 1]
    try:
        comm.all_reduce(column, dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_strided_tensor_is_refused_on_every_backend():
    """gloo's all_reduce of a strided view sums the wrong elements of its storage; NCCL refuses
    it: megalite refuses it on both."""
    for said in run_ranks(2, _reduce_a_strided_view, timeout=60):
        assert said.startswith("all_reduce of a non-contiguous tensor (3,)"), said
