"""The collective-sequence guard: every `run_ranks` compares the ranks' records of their
collectives and p2p messages, and names the first call on which a group disagrees."""

import pytest
import torch
import torch.distributed as dist

from megalite import comm
from megalite.comm_trace import CollectiveMismatch, check_traces
from megalite.launch import run_ranks


def _rank_sized_all_reduce() -> None:
    comm.all_reduce(torch.ones(4), dist.group.WORLD)  # agreed
    comm.all_reduce(torch.ones(3 + dist.get_rank()), dist.group.WORLD)  # a rank-local size


def test_a_rank_dependent_collective_size_is_named():
    with pytest.raises(
        AssertionError,
        match=r"call #1 of group default_pg@0,1 \(of 2\): rank 0: all_reduce "
        r"float32x3; rank 1: all_reduce float32x4",
    ):
        run_ranks(2, _rank_sized_all_reduce, timeout=30)


def _mismatched_send() -> None:
    if dist.get_rank() == 0:
        batch = comm.post_p2p([(torch.ones(5), 1)], [], dist.group.WORLD)
    else:
        batch = comm.post_p2p([], [(torch.empty(5, dtype=torch.float64), 0)], dist.group.WORLD)
    batch.wait()


def test_a_send_and_its_receive_must_agree():
    with pytest.raises(
        AssertionError, match=r"p2p default_pg@0->1.*rank 0: float32x5; rank 1: float64x5"
    ):
        run_ranks(2, _mismatched_send, timeout=30)


def test_records_of_agreeing_ranks_pass(tmp_path):
    """Identical records pass; a member that stopped early only fails a complete run."""
    (tmp_path / "rank0.trace").write_text("group 0,1 all_reduce float32x4\nsend pp@1 float32x8\n")
    (tmp_path / "rank1.trace").write_text("group 0,1 all_reduce float32x4\nrecv pp@0 float32x8\n")
    check_traces(tmp_path)
    (tmp_path / "rank0.trace").write_text(
        "group 0,1 all_reduce float32x4\nsend pp@1 float32x8\ngroup 0,1 barrier -\n"
    )
    check_traces(tmp_path, complete=False)
    with pytest.raises(CollectiveMismatch, match=r"rank 0: barrier -; rank 1: \(nothing\)"):
        check_traces(tmp_path)
