"""The float8 GEMMs of a column-parallel linear and the row-parallel one after it (one layer's
pair, so SP's backward gathers the row's output gradient with the column's kept input) at tp 2,
with and without SP, equal the same linears in one process, for both recipes: outputs, input
and weight gradients. Every tensor spans 2^40 in magnitude across the halves tp and SP cut it
into, so a scale taken from a rank's own piece instead of the whole tensor flushes (or keeps)
values the single process keeps (or flushes): the results would differ by far more than the
tolerance, which only fp32 summation order uses up."""

import pytest
import torch
import torch.nn.functional as F

from megalite.float8.gemm import Float8Training
from megalite.float8.scaling import RECIPES
from megalite.launch import run_ranks
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    sequence_shard,
)
from megalite.tensor_parallel.linear import LinearPair

B, S, H, F_ = 2, 8, 32, 48


def _spread(shape: tuple[int, ...], signs: tuple[int, ...]) -> torch.Tensor:
    """randn whose halves along each dim differ by 2^16: x 2^8 for the first half and x 2^-8
    for the second where the dim's sign is 1, the other way round for -1 (0: even). Along
    every contracted dim the two operands have opposite signs, so both halves weigh alike in
    the product and a cast of either half shows in it."""
    t = torch.randn(*shape)
    for dim, (size, sign) in enumerate(zip(shape, signs)):
        half = torch.where(torch.arange(size) < size // 2, 2.0 ** (8 * sign), 2.0 ** (-8 * sign))
        t = t * half.view(*([1] * dim), size, *([1] * (len(shape) - dim - 1)))
    return t


def _layers(ps: ParallelState, sp: bool, float8: Float8Training, weights):
    pair = LinearPair()
    linear = dict(bias=False, init=lambda t, g: None, sequence_parallel=sp, pair=pair)
    column = ColumnParallelLinear(H, F_, ps, float8=float8, **linear)
    row = RowParallelLinear(F_, H, ps, float8=float8, **linear)
    tp, r = ps.size("tp"), ps.coord("tp")
    w1, w2 = weights
    column.weight.data.copy_(w1.chunk(tp, 0)[r])
    row.weight.data.copy_(w2.chunk(tp, 1)[r])
    return column, row


def _run(ps: ParallelState, sp: bool, float8: Float8Training, tensors):
    """y = row(gelu(column(x))) and its gradients, for this rank's pieces."""
    w1, w2, x, g = tensors
    column, row = _layers(ps, sp, float8, (w1, w2))
    group = ps.group("tp")
    x_in = (sequence_shard(x, group) if sp else x).clone().requires_grad_()
    y = row(F.gelu(column(x_in)))
    (y * (sequence_shard(g, group) if sp else g)).sum().backward()
    return y, x_in.grad, column.weight.grad, row.weight.grad


def _compare(recipe: str, sp: bool) -> dict[str, float]:
    ps = build_parallel_state(2, 1, torch.device("cpu"))
    torch.manual_seed(0)  # the same full tensors on every rank
    w1, w2 = _spread((F_, H), (1, -1)), _spread((H, F_), (1, -1))
    x, g = _spread((B, S, H), (0, 1, 1)), _spread((B, S, H), (0, -1, -1))
    tensors = (w1, w2, x, g)
    float8 = Float8Training(RECIPES[recipe], min_dim=0)
    y, dx, dw1, dw2 = _run(ps, sp, float8, tensors)
    ref_y, ref_dx, ref_dw1, ref_dw2 = _run(ParallelState.single(), False, float8, tensors)
    r, group = ps.coord("tp"), ps.group("tp")
    expected = {
        "y": sequence_shard(ref_y, group) if sp else ref_y,
        "dx": sequence_shard(ref_dx, group) if sp else ref_dx,
        "dw_column": ref_dw1.chunk(2, 0)[r],
        "dw_row": ref_dw2.chunk(2, 1)[r],
    }
    got = {"y": y, "dx": dx, "dw_column": dw1, "dw_row": dw2}
    return {name: _worst(got[name], expected[name]) for name in got}


def _worst(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error of any element relative to its own row's magnitude (a flushed small
    block next to a large one shows, where a tensor-wide norm would hide it)."""
    scale = expected.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return ((got - expected).abs() / scale).max().item()


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linears_quantise_as_one_process_does(recipe, sp):
    for rank, errors in enumerate(run_ranks(2, _compare, recipe, sp)):
        for name, error in errors.items():
            assert error < 1e-6, f"rank {rank} {name}: {error:.2e}"
