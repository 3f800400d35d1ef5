"""comm's reduce-scatter and all-gather: each rank gets the sum of its piece / every rank's shard
in order, blocking and asynchronous, flat and along a middle dim, at 2 and 4 ranks, for fp32
and bf16; on gloo both as all-to-alls (the reduce-scatter with a local sum, not
ProcessGroupGloo's clone + all-reduce + copy; the all-gather sending each rank a copy of the
shard, faster than gloo's allgather), and through the backend's own collectives, the path
NCCL takes (`backend` below: gloo runs it too)."""

import pytest
import torch
import torch.distributed as dist

from megalite import comm
from megalite.launch import run_ranks

PATHS = ["all_to_all", "backend"]


def _take(path: str) -> None:
    """Route this rank's collectives as on gloo (all-to-alls) or as on NCCL (the backend's
    all_gather_into_tensor / reduce_scatter_tensor)."""
    if path == "backend":
        comm._on_gloo_cpu = lambda tensor, group: False


def _reduce_scatters(dtype: torch.dtype, path: str) -> list[float]:
    _take(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    generator = torch.Generator().manual_seed(7)
    every_rank = torch.randn(world, 3, 4 * world, 5, generator=generator, dtype=torch.float64)
    mine = every_rank[rank].to(dtype)
    expected = every_rank.to(dtype).double().sum(0).chunk(world, dim=1)[rank]  # (3, 4, 5)
    errors = []
    for async_op in (False, True):
        flat = torch.empty(mine.numel() // world, dtype=dtype)
        source = mine.movedim(1, 0).contiguous().view(-1)
        handle = comm.reduce_scatter_flat(flat, source, group, async_op=async_op)
        if async_op:
            handle.wait()
        got_flat = flat.view(4, 3, 5).movedim(0, 1)
        got_dim = comm.reduce_scatter(mine, group, dim=1)
        for got in (got_flat, got_dim):
            assert got.shape == expected.shape and got.dtype == dtype
            errors.append(((got.double() - expected).norm() / expected.norm()).item())
    return errors


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reduce_scatter_sums_each_rank_piece(world_size, dtype, path):
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for errors in run_ranks(world_size, _reduce_scatters, dtype, path):
        assert max(errors) < tolerance, errors


def _all_gathers(dtype: torch.dtype, path: str) -> list[bool]:
    _take(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    every_rank = torch.randn(world, 3, 4, 5, generator=torch.Generator().manual_seed(9))
    every_rank = every_rank.to(dtype)
    expected = torch.cat(list(every_rank), dim=1)  # (3, 4 * world, 5): rank order along dim 1
    results = []
    for async_op in (False, True):
        flat = torch.empty(every_rank.numel(), dtype=dtype)
        handle = comm.all_gather_flat(flat, every_rank[rank].reshape(-1), group, async_op)
        if async_op:
            handle.wait()
        results.append(torch.equal(flat, every_rank.reshape(-1)))
    results.append(torch.equal(comm.all_gather(every_rank[rank], group, dim=1), expected))
    # two tensors of other shapes in one call (SP's backward): each joined along dim 1
    others = torch.randn(world, 3, 2, 7, generator=torch.Generator().manual_seed(3)).to(dtype)
    pair = [every_rank[rank], others[rank]]
    first, second = comm.all_gather_together_start(pair, group, dim=1).wait()
    results.append(torch.equal(first, expected) and first.is_contiguous())
    results.append(torch.equal(second, torch.cat(list(others), dim=1)) and second.is_contiguous())
    return results


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_gather_concatenates_every_rank_shard(world_size, dtype, path):
    for results in run_ranks(world_size, _all_gathers, dtype, path):
        assert results == [True] * 5
