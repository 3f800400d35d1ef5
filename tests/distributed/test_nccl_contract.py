"""The NCCL contract as the test mode emulates it (`megalite.nccl_contract`): one work per batch
and sends that complete only when matched; megalite's p2p correct for either return shape."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from megalite import comm, nccl_contract
from megalite.launch import run_ranks


def _batch_shapes(nccl_like: bool) -> tuple[int, bool]:
    """Rank 0 sends one tensor and receives another from rank 1 in one batch, rank 1 the other
    way round: how many works the backend returned, and whether the received values arrived."""
    rank = dist.get_rank()
    ops = [
        dist.P2POp(dist.isend, torch.full((4,), float(rank)), 1 - rank),
        dist.P2POp(dist.irecv, received := torch.empty(4), 1 - rank),
    ]
    batch_isend_irecv = nccl_contract.batch_isend_irecv if nccl_like else dist.batch_isend_irecv
    works = batch_isend_irecv(ops)
    for work in works:
        work.wait()
    return len(works), bool((received == 1 - rank).all())


@pytest.mark.parametrize("nccl_like,works", [(True, 1), (False, 2)], ids=["nccl", "gloo"])
def test_a_batch_returns_what_its_backend_returns(nccl_like, works):
    """NCCL coalesces a batch into one work (`cm.works` in torch's batch_isend_irecv); gloo
    returns one per op."""
    assert run_ranks(2, _batch_shapes, nccl_like, timeout=60) == [(works, True)] * 2


def _time_to_post_a_send(nccl_like: bool, receiver_delay_s: float) -> float:
    """Seconds rank 0's post of a lone send takes while rank 1 posts its receive late."""
    comm.barrier()
    if dist.get_rank() == 1:
        time.sleep(receiver_delay_s)
        ops = [dist.P2POp(dist.irecv, torch.empty(1024), 0)]
    else:
        ops = [dist.P2POp(dist.isend, torch.ones(1024), 1)]
    start = time.perf_counter()
    works = (nccl_contract.batch_isend_irecv if nccl_like else dist.batch_isend_irecv)(ops)
    posted = time.perf_counter() - start
    for work in works:
        work.wait()
    return posted


@pytest.mark.serial
def test_a_send_completes_only_when_its_receive_is_posted():
    """Under NCCL a send's batch ends only when the receiver reaches the receive; gloo's post
    returns at once. (The pipeline tests run every schedule under this rule, where a receive
    posted too late deadlocks.)"""
    delay = 1.0
    nccl = run_ranks(2, _time_to_post_a_send, True, delay, timeout=60)[0]
    gloo = run_ranks(2, _time_to_post_a_send, False, delay, timeout=60)[0]
    assert nccl >= 0.8 * delay
    assert gloo < 0.5 * delay


def _executor_style_batches(nccl_like: bool) -> list[float]:
    """comm.post_p2p as the pipeline executor uses it: a batch that sends before it receives,
    its receive waited for through the batch's handle, whatever shape the backend returned."""
    os.environ[nccl_contract.NCCL_LIKE_P2P_ENV] = "1" if nccl_like else "0"
    comm.barrier()
    rank, got = dist.get_rank(), []
    for step in range(3):
        buffer = torch.empty(8)
        message = torch.full((8,), 10.0 * step + rank)
        batch = comm.post_p2p([(message, 1 - rank)], [(buffer, 1 - rank)])
        batch.wait()
        batch.wait()  # a second wait is harmless (gloo hangs on waiting a work twice)
        assert batch.is_completed()
        got.append(buffer[0].item())
    return got


@pytest.mark.parametrize("nccl_like", [True, False], ids=["nccl", "gloo"])
def test_post_p2p_receives_are_ready_after_the_batch(nccl_like):
    assert run_ranks(2, _executor_style_batches, nccl_like, timeout=60) == [
        [1.0, 11.0, 21.0],
        [0.0, 10.0, 20.0],
    ]


def _received_before_and_after_the_wait() -> tuple[bool, bool]:
    """Each rank receives the other's ones through `comm.post_p2p` under the emulation."""
    rank = dist.get_rank()
    received = torch.zeros(4)
    batch = comm.post_p2p([(torch.ones(4), 1 - rank)], [(received, 1 - rank)])
    before = bool(received.isnan().all())
    batch.wait()
    return before, bool((received == 1).all())


def test_a_receive_lands_only_when_its_work_is_seen_complete(monkeypatch):
    """On NCCL a receive buffer holds its old contents until the work completes; the emulation
    holds NaN there until the work is waited on (or polled complete), so a read that skips
    the wait fails a test here rather than a run on GPUs."""
    monkeypatch.setenv(nccl_contract.NCCL_LIKE_P2P_ENV, "1")
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
