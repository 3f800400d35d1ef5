"""The autograd functions of the column- and row-parallel linears, in the style of Megatron-LM's
`LinearWithGradAccumulationAndAsyncCommunication`.

Column-parallel (q, k, v and gate, up are one fused weight each: `FusedColumnParallelLinear`):
- forward: all-gather the sequence shards (SP), one GEMM; keep the SHARD for backward, not
  the gathered input (s*b*h/t instead of s*b*h per layer input);
- backward: start the all-gather of the shard again and compute the input gradient under it;
  start the input gradient's reduce-scatter (SP) or all-reduce and compute the weight
  gradients under it; then wait.
Row-parallel: forward reduce-scatters (SP) or all-reduces the partial products; backward
all-gathers the output gradient (SP); its input gradient needs no communication.

Both are opaque to torch.compile (`train.compile`): a compiled block runs eagerly through them,
so their collectives, overlap and observers stay exactly as written here.

Weight gradients go straight into the fp32 main grad when the gradient buffer gave the
parameter an `accumulate_main_grad` (data_parallel/grad_buffer.py): no 16-bit `.grad` is made.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megalite import comm
from megalite.eager_boundary import eager_only

SEQ_DIM = 1
"""Activations are (batch, seq, hidden): SP shards dim 1."""

Rows = tuple[slice, ...] | None
"""The rows of a weight a linear computes, in order (q and a shared kv head of a fused q/k/v:
`ColumnOutput.shared_heads`); None: all."""


def _used(weight: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
    """The rows computed: the weight itself, a view, or (a shared kv head beside q) a copy of
    the rows, one weight-sized copy that keeps the product one GEMM."""
    if weight is None or rows is None:
        return weight
    if len(rows) == 1:
        return weight[rows[0]]
    return torch.cat([weight[piece] for piece in rows])


def _weight_grad(
    weight: torch.Tensor, rows: Rows, x: torch.Tensor | None, dy: torch.Tensor
) -> torch.Tensor | None:
    """dW = dy^T x for x (tokens, in), dy (tokens, out); a bias's gradient (x None) sums dy over
    the tokens. Added into the fp32 main grad when the parameter has one (None is returned:
    autograd makes no `.grad`), else returned."""
    accumulate = getattr(weight, "accumulate_main_grad", None)
    if accumulate is not None:
        accumulate(dy, x, rows)
        return None
    grad = dy.sum(0) if x is None else dy.t() @ x
    if rows is None:
        return grad
    full, start = grad.new_zeros(weight.shape), 0
    for piece in rows:
        end = start + piece.stop - piece.start
        full[piece] = grad[start:end]
        start = end
    return full


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _ColumnParallel(torch.autograd.Function):
    """forward: all-gather along the sequence (SP) or identity, then y = x W^T + b;
    backward: all-gather again (SP), dx = dy W reduce-scattered along the sequence (SP) or
    all-reduced, overlapped with dW = dy^T x."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, rows):
        total = comm.all_gather(x, group, SEQ_DIM) if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel, ctx.rows = group, sequence_parallel, rows
        ctx.bias = bias  # a parameter (leaf): for its main grad, not a saved tensor
        return F.linear(total, _used(weight, rows), _used(bias, rows))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        group, rows = ctx.group, ctx.rows
        gather = comm.all_gather_start(x, group, SEQ_DIM) if ctx.sequence_parallel else None
        reduction = None
        if ctx.needs_input_grad[0]:
            dx = dy @ _used(weight, rows)
        total = x if gather is None else gather.wait()  # (b, s, in): the full sequence
        if ctx.needs_input_grad[0]:
            if ctx.sequence_parallel:
                reduction = comm.reduce_scatter_start(dx, group, SEQ_DIM)
            else:
                reduction = comm.Pending(comm.all_reduce(dx, group, async_op=True), lambda: dx)
        # the weight gradient runs while the input gradient's reduction is in flight; bias
        # before weight: the order autograd delivers leaf gradients in (ZeRO-2's staging
        # estimate replays it: profiling.parameters.gradient_arrival)
        flat_dy, wgrad, bgrad = _flat(dy), None, None
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            bgrad = _weight_grad(ctx.bias, rows, None, flat_dy)
        if ctx.needs_input_grad[1]:
            wgrad = _weight_grad(weight, rows, _flat(total), flat_dy)
        dx = None if reduction is None else reduction.wait()
        return dx, wgrad, bgrad, None, None, None


class _RowParallel(torch.autograd.Function):
    """forward: y = x W^T, partial sums reduce-scattered along the sequence (SP) or all-reduced;
    backward: all-gather dy along the sequence (SP), dx = dy W, dW = dy^T x."""

    @staticmethod
    def forward(ctx, x, weight, group, sequence_parallel):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        y = F.linear(x, weight)  # (b, s, out): a partial sum over tp
        if sequence_parallel:
            return comm.reduce_scatter(y, group, SEQ_DIM)
        comm.all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if ctx.sequence_parallel:
            dy = comm.all_gather(dy, ctx.group, SEQ_DIM)  # (b, s, out)
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = _weight_grad(weight, None, _flat(x), _flat(dy)) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


@eager_only
def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Rows,
    group: Any,
    sequence_parallel: bool,
) -> torch.Tensor:
    """y = x W[rows]^T + b[rows], x the sequence shard (SP) or the replicated input; y covers
    the full sequence."""
    return _ColumnParallel.apply(x, weight, bias, group, sequence_parallel, rows)


@eager_only
def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, group: Any, sequence_parallel: bool
) -> torch.Tensor:
    """x W^T summed over tp: the sequence shard (SP) or the full, replicated result."""
    return _RowParallel.apply(x, weight, group, sequence_parallel)
