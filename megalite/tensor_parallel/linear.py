"""The autograd functions of the column- and row-parallel linears, in the style of Megatron-LM's
`LinearWithGradAccumulationAndAsyncCommunication`.

Column-parallel (q, k, v and gate, up are one fused weight each: `FusedColumnParallelLinear`):
- forward: all-gather the sequence shards (SP) and multiply (one GEMM without SP); keep the
  SHARD for backward, not the gathered input (s*b*h/t instead of s*b*h per layer input);
- backward: start the all-gather of the shard again and compute the input gradient under it;
  start the input gradient's reduce-scatter (SP) or all-reduce and compute the weight
  gradients under it; then wait.
Row-parallel: forward reduce-scatters (SP) or all-reduces the partial products; backward
all-gathers the output gradient (SP) and multiplies it; its input gradient needs no
communication.

Under SP every GEMM next to a collective is split by tokens so that the collective hides under
it (Wang et al. 2023; the TP overlap of Megatron-LM and torchtitan). A GEMM that needs an
all-gathered input (the column's forward, the row's input gradient) multiplies this rank's own
tokens, which are in its shard, while the other ranks' shards are in flight, and theirs once
they arrive (`_product_under_gather`). The row's forward multiplies the other ranks' tokens
first and sends those partial sums, then multiplies its own while they travel
(`_product_then_scatter`).

Under SP a block's row-parallel linear (attention output, down projection) follows a
column-parallel one (q/k/v, gate/up) whose backward runs right after its own: its *partner*,
which the layer owning both hands it through a `LinearPair` (the column's backward node, never
a module global). The row's backward gathers its output gradient and the partner's input shard
in one all-gather, and the partner's backward uses that gather instead of starting its own: the
same bytes in half the backward all-gathers, each of which pays a fixed cost (latency, a
launch). Megatron's backward issues the two separately. The partner's input is then held
gathered through the sublayer's core backward (attention, activation), one (b, s, h) tensor
at a time, as a (b, s, out) output gradient is.

Both are opaque to torch.compile (`train.compile`): a compiled block runs eagerly through them,
so their collectives, overlap and observers stay exactly as written here. At tp 1, where there
is nothing to communicate, a compiled block uses `traced_linear` instead (training/compile.py).

Weight gradients go straight into the fp32 main grad when the gradient buffer gave the
parameter an `accumulate_main_grad` (data_parallel/grad_buffer.py): no 16-bit `.grad` is made.
Under a zero-bubble schedule's B step (the model's `deferred.Deferral`, which reaches the
linears through their `LinearPair`) both linears compute only the input gradient and leave the
weight gradient, with x and dy, to the W step; under SP each keeps only the sequence shard it
was given (the column-parallel linear's x, the row-parallel one's dy) and gathers it again in
W: one more all-gather per linear, and t times less memory held from B to W.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megalite import comm
from megalite.eager_boundary import eager_only
from megalite.tensor_parallel.deferred import Deferral, WeightGradQueue
from megalite.tensor_parallel.mappings import (
    all_gather_sequence,
    all_gather_sequence_start,
    all_gather_sequence_together_start,
    reduce_scatter_sequence_start,
    sequence_shard,
    shard_tokens,
)

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


Product = Callable[[torch.Tensor, torch.Tensor], Any]
"""A GEMM of a linear's tokens: `product(a, out)` writes a (tokens, in) @ M into `out`."""


def _product_under_gather(
    shard: torch.Tensor, gather: comm.Pending, group: Any, product: Product, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, full): `product` of every token of the full sequence that `gather` brings from the
    ranks' SP shards, as (b, s, width), and that full sequence. This rank's own tokens, its
    `shard`, are multiplied while the other ranks' are in flight, the rest once they are here:
    a GEMM that depends on a collective, decomposed so that the collective hides under it."""
    b, local = shard.shape[:2]
    y = shard.new_empty((b, local * comm.size(group), width))
    flat_y = y.view(-1, width)
    own = shard_tokens(shard, group)
    product(_flat(shard), flat_y[own])
    full = gather.wait()
    flat_full = _flat(full)
    for others in (slice(0, own.start), slice(own.stop, flat_y.shape[0])):
        if others.stop > others.start:
            product(flat_full[others], flat_y[others])
    return y, full


def _product_then_scatter(
    x: torch.Tensor, group: Any, product: Product, width: int
) -> torch.Tensor:
    """This rank's SP shard (b, s/t, width) of `product` of the full sequence `x` (b, s, in),
    summed over the group. The other ranks' tokens are multiplied first and sent; this rank's
    own are multiplied while they travel, and the partial sums received are added to them: a
    reduce-scatter decomposed around the GEMM before it."""
    shard = sequence_shard(x, group)  # this rank's own tokens (b, s/t, in)
    flat_x, flat_shard = _flat(x), _flat(shard)
    own = shard_tokens(shard, group)
    others = flat_x.new_empty((flat_x.shape[0] - flat_shard.shape[0], width))
    if own.start > 0:  # the ranks before this one, then those after
        product(flat_x[: own.start], others[: own.start])
    if own.stop < flat_x.shape[0]:
        product(flat_x[own.stop :], others[own.start :])

    def own_product() -> torch.Tensor:
        y = flat_x.new_empty((flat_shard.shape[0], width))
        product(flat_shard, y)
        return y

    summed = comm.reduce_scatter_own_last(others, own_product, group)
    return summed.view(*shard.shape[:2], width)


def _times(matrix: torch.Tensor, bias: torch.Tensor | None = None) -> Product:
    """The product a @ matrix (+ bias)."""
    if bias is None:
        return lambda a, out: torch.mm(a, matrix, out=out)
    return lambda a, out: torch.addmm(bias, a, matrix, out=out)


def _column_weight_grads(
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: Rows,
    total: torch.Tensor,
    dy: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dW, db) of a column-parallel linear from its full-sequence input. Bias before weight:
    the order autograd delivers leaf gradients in (ZeRO-2's staging estimate replays it:
    profiling.parameters.gradient_arrival)."""
    flat_dy = _flat(dy)
    bgrad = None if bias is None else _weight_grad(bias, rows, None, flat_dy)
    wgrad = None if weight is None else _weight_grad(weight, rows, _flat(total), flat_dy)
    return wgrad, bgrad


def _deferred_column_weight_grads(
    x: torch.Tensor,
    group: Any,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rows: Rows,
    dy: torch.Tensor,
) -> None:
    """W of a column-parallel linear: gather its sequence shards again (SP: `group`), then add
    dW and db into the main grads."""
    _column_weight_grads(
        weight, bias, rows, x if group is None else all_gather_sequence(x, group), dy
    )


def _deferred_row_weight_grad(
    x: torch.Tensor, group: Any, weight: torch.Tensor, dy: torch.Tensor
) -> None:
    """W of a row-parallel linear: gather its output gradient's sequence shards again (SP:
    `group`; B kept only the shard), then add dW into the main grad."""
    full = dy if group is None else all_gather_sequence(dy, group)
    _weight_grad(weight, None, _flat(x), _flat(full))


class LinearPair:
    """What a layer's column-parallel linear and the row-parallel one after it share in
    backward, handed to both by the layer that builds them: the model's `Deferral` (a B step's
    queue for their weight gradients), and under SP the column's latest backward node, which
    the row's forward takes as its partner (`_gather_output_grad`)."""

    def __init__(self, deferral: Deferral | None = None) -> None:
        self.deferral = deferral
        self._column: weakref.ref | None = None

    def column_ran(self, node: Any) -> None:
        """The column-parallel linear's forward under SP made `node`."""
        self._column = weakref.ref(node)

    def take_column(self) -> Any:
        """The backward node of the column-parallel linear the row-parallel one follows (SP):
        the block's q/k/v before its attention output, its gate/up (fc) before its down
        projection. Its backward runs right after the row's. Taken once: a row-parallel linear
        with no column-parallel one run before it finds none (never an earlier micro-batch's)."""
        column = None if self._column is None else self._column()
        self._column = None
        return column


def _queue(ctx: Any, *params: torch.Tensor | None) -> WeightGradQueue | None:
    """Where a linear's backward node `ctx` puts the weight gradients of `params`: its model's
    open B-step queue (`Deferral.queue_for`), or None (now)."""
    pair = ctx.pair
    if pair is None or pair.deferral is None:
        return None
    return pair.deferral.queue_for(*params)


def _column_grad_params(ctx: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias) of a column-parallel linear's backward node, each None when it needs no
    gradient."""
    weight = ctx.weight if ctx.needs_input_grad[1] else None
    return weight, ctx.bias if ctx.needs_input_grad[2] else None


class _ColumnParallel(torch.autograd.Function):
    """forward: all-gather the sequence shards (SP) or identity, then y = x W^T + b;
    backward: all-gather again (SP; or take the gather its partner did), dx = dy W
    reduce-scattered to sequence shards (SP) or all-reduced, overlapped with dW = dy^T x."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, rows, pair):
        # Only x is saved: a row-parallel partner may unpack it before this backward runs, and
        # recompute's saved tensors unpack once. The parameters themselves are kept instead
        # (their main grads need the objects; a saved-tensor hook, the memory tracker's, may
        # unpack a saved parameter as another tensor object).
        ctx.save_for_backward(x)
        ctx.group, ctx.sequence_parallel, ctx.rows = group, sequence_parallel, rows
        ctx.weight, ctx.bias, ctx.pair = weight, bias, pair
        ctx.gathered = None  # x's full sequence, when the partner gathered it (SP)
        used_weight, used_bias = _used(weight, rows), _used(bias, rows)
        if not sequence_parallel:
            return F.linear(x, used_weight, used_bias)
        if pair is not None:
            pair.column_ran(ctx)
        gather = all_gather_sequence_start(x, group)
        product = _times(used_weight.t(), used_bias)
        y, _ = _product_under_gather(x, gather, group, product, used_weight.shape[0])
        return y

    @staticmethod
    def backward(ctx, dy):
        group, rows, sp = ctx.group, ctx.rows, ctx.sequence_parallel
        grad_weight, grad_bias = _column_grad_params(ctx)
        queue = _queue(ctx, grad_weight, grad_bias)
        total, ctx.gathered = ctx.gathered, None
        x = None if total is not None else ctx.saved_tensors[0]
        gather = None
        if sp and queue is None and total is None and grad_weight is not None:
            gather = all_gather_sequence_start(x, group)
        reduction = None
        if ctx.needs_input_grad[0]:
            dx = dy @ _used(ctx.weight, rows)
        if gather is not None:
            total = gather.wait()  # (b, s, in): the full sequence
        elif total is None:
            total = x
        if ctx.needs_input_grad[0]:
            if sp:
                reduction = reduce_scatter_sequence_start(dx, group)
            else:
                reduction = comm.Pending(comm.all_reduce(dx, group, async_op=True), lambda: dx)
        # the weight gradient runs while the input gradient's reduction is in flight
        wgrad = bgrad = None
        if queue is not None:
            gather_group = group if sp else None
            work = (
                _deferred_column_weight_grads,
                x,
                gather_group,
                grad_weight,
                grad_bias,
                rows,
                dy,
            )
            queue.put(functools.partial(*work), x, dy)
        else:
            wgrad, bgrad = _column_weight_grads(grad_weight, grad_bias, rows, total, dy)
        dx = None if reduction is None else reduction.wait()
        return dx, wgrad, bgrad, None, None, None, None


def _gather_output_grad(ctx: Any, shard: torch.Tensor) -> comm.Pending:
    """Start gathering the row-parallel output gradient's full sequence (SP). The partner's
    backward will gather its own input's shards again; both go in one all-gather (fewer
    collectives, the same bytes) unless the partner has nothing to gather now (no weight
    gradient, or deferred to a W step) or the dtypes differ."""
    partner = ctx.partner
    if partner is not None and partner.gathered is None:
        weight, bias = _column_grad_params(partner)
        if weight is not None and _queue(partner, weight, bias) is None:
            (x,) = partner.saved_tensors
            if x.dtype == shard.dtype:
                both = all_gather_sequence_together_start([shard, x], ctx.group)

                def output_grad() -> torch.Tensor:
                    dy, partner.gathered = both.wait()
                    return dy

                return comm.Pending(None, output_grad)
    return all_gather_sequence_start(shard, ctx.group)


class _RowParallel(torch.autograd.Function):
    """forward: y = x W^T, partial sums reduce-scattered to sequence shards (SP) or all-reduced;
    backward: all-gather dy's sequence shards (SP; with the partner's input, see
    `_gather_output_grad`), dx = dy W, dW = dy^T x."""

    @staticmethod
    def forward(ctx, x, weight, group, sequence_parallel, pair):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel, ctx.pair = group, sequence_parallel, pair
        ctx.weight = weight  # the parameter itself, for its main grad (see _ColumnParallel)
        ctx.partner = pair.take_column() if sequence_parallel and pair is not None else None
        if sequence_parallel and comm.size(group) > 1:  # y: partial sums over tp, scattered
            return _product_then_scatter(x, group, _times(weight.t()), weight.shape[0])
        y = F.linear(x, weight)  # (b, s, out): a partial sum over tp
        comm.all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, shard):
        x, weight = ctx.saved_tensors
        gather_group = ctx.group if ctx.sequence_parallel else None
        wants_dx = ctx.needs_input_grad[0]
        if gather_group is None:
            dy = shard
            dx = dy @ weight if wants_dx else None
        elif wants_dx:  # dx = dy W: this rank's tokens while the others' dy is gathered
            gather = _gather_output_grad(ctx, shard)
            dx, dy = _product_under_gather(shard, gather, ctx.group, _times(weight), x.shape[-1])
        else:
            dx, dy = None, _gather_output_grad(ctx, shard).wait()
        ctx.partner = None
        dw = None
        if ctx.needs_input_grad[1]:
            queue = _queue(ctx, ctx.weight)
            if queue is not None:
                work = (_deferred_row_weight_grad, x, gather_group, ctx.weight, shard)
                queue.put(functools.partial(*work), x, shard)
            else:
                dw = _weight_grad(ctx.weight, None, _flat(x), _flat(dy))
        return dx, dw, None, None, None


def traced_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: Rows = None
) -> torch.Tensor:
    """x W[rows]^T + b[rows] by autograd alone, which torch.compile traces: a linear with no
    tensor-parallel peer (tp 1) and no deferred weight gradient needs none of the above. Its
    weight gradient arrives as a `.grad`, which the gradient buffer moves into the fp32 main
    grad (`train.compile` at tp 1: training/compile.py)."""
    return F.linear(x, _used(weight, rows), _used(bias, rows))


@eager_only
def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Rows,
    group: Any,
    sequence_parallel: bool,
    pair: LinearPair | None = None,
) -> torch.Tensor:
    """y = x W[rows]^T + b[rows], x the sequence shard (SP) or the replicated input; y covers
    the full sequence. `pair`: shared with the row-parallel linear after it (None: none, and
    no deferral)."""
    return _ColumnParallel.apply(x, weight, bias, group, sequence_parallel, rows, pair)


@eager_only
def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    sequence_parallel: bool,
    pair: LinearPair | None = None,
) -> torch.Tensor:
    """x W^T summed over tp: the sequence shard (SP) or the full, replicated result. `pair`:
    shared with the column-parallel linear before it (None: none, and no deferral)."""
    return _RowParallel.apply(x, weight, group, sequence_parallel, pair)
