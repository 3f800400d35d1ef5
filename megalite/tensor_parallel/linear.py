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

The products themselves are a `gemms.Gemms`'s: in the compute dtype, or under `train.fp8` in
float8 (`gemms.Float8Gemms`), which keeps what it needs of x (tensorwise: x's float8 cast, which
SP then gathers as bytes) and casts dy before any gather starts; the communication is the same.

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
from typing import Any

import torch

from megalite import comm
from megalite.eager_boundary import eager_only
from megalite.float8.gemm import Float8Training
from megalite.float8.scaling import FLOAT8_DTYPES
from megalite.tensor_parallel.deferred import Deferral, WeightGradQueue
from megalite.tensor_parallel.gemms import (
    Gemms,
    Product,
    Rows,
    RowsProduct,
    column_splits,
    flat,
    gemms_for,
    row_splits,
    used,
)
from megalite.tensor_parallel.mappings import (
    all_gather_sequence_start,
    all_gather_sequence_together_start,
    reduce_scatter_sequence_start,
    sequence_shard,
    shard_tokens,
)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as the bytes a collective carries (gloo has no float8); else itself."""
    return t.view(torch.uint8) if t.dtype in FLOAT8_DTYPES else t


def _gather_start(shard: torch.Tensor, group: Any) -> comm.Pending:
    """`all_gather_sequence_start` of a shard in any dtype, float8 included (as bytes)."""
    gather = all_gather_sequence_start(_wire(shard), group)
    return comm.Pending(None, lambda: gather.wait().view(shard.dtype))


def _product_under_gather(
    shard: torch.Tensor,
    gather: comm.Pending,
    group: Any,
    product: Product,
    width: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, full): `product` of every token of the full sequence that `gather` brings from the
    ranks' SP shards, as (b, s, width) in `dtype`, and that full sequence. This rank's own
    tokens, its `shard`, are multiplied while the other ranks' are in flight, the rest once
    they are here: a GEMM that depends on a collective, decomposed so that the collective
    hides under it."""
    b, local = shard.shape[:2]
    y = torch.empty((b, local * comm.size(group), width), dtype=dtype, device=shard.device)
    flat_y = y.view(-1, width)
    own = shard_tokens(shard, group)
    product(flat(shard), flat_y[own])
    full = gather.wait()
    flat_full = flat(full)
    for others in (slice(0, own.start), slice(own.stop, flat_y.shape[0])):
        if others.stop > others.start:
            product(flat_full[others], flat_y[others])
    return y, full


def _product_then_scatter(
    x: torch.Tensor, group: Any, product: RowsProduct, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's SP shard (b, s/t, width) of `product` of the full sequence `x` (b, s, in),
    summed over the group, in `dtype`. The other ranks' tokens are multiplied first and sent;
    this rank's own are multiplied while they travel, and the partial sums received are added
    to them: a reduce-scatter decomposed around the GEMM before it."""
    shard = sequence_shard(x, group)  # this rank's own tokens (b, s/t, in)
    tokens, own = x.shape[0] * x.shape[1], shard_tokens(shard, group)
    others = torch.empty((tokens - (own.stop - own.start), width), dtype=dtype, device=x.device)
    if own.start > 0:  # the ranks before this one, then those after
        product(slice(0, own.start), others[: own.start])
    if own.stop < tokens:
        product(slice(own.stop, tokens), others[own.start :])

    def own_product() -> torch.Tensor:
        y = torch.empty((own.stop - own.start, width), dtype=dtype, device=x.device)
        product(own, y)
        return y

    summed = comm.reduce_scatter_own_last(others, own_product, group)
    return summed.view(*shard.shape[:2], width)


def _column_weight_grads(
    gemms: Gemms,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    total: torch.Tensor,
    dy: torch.Tensor,
    grad: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dW, db) of a column-parallel linear from its kept input's full sequence, dy and what
    its GEMMs made of dy (`Gemms.output_grad`). Bias before weight: the order autograd
    delivers leaf gradients in (ZeRO-2's staging estimate replays it:
    profiling.parameters.gradient_arrival)."""
    bgrad = None if bias is None else gemms.bias_grad(bias, flat(dy))
    wgrad = (
        None if weight is None else gemms.weight_grad(weight, gemms.rows, flat(total), flat(grad))
    )
    return wgrad, bgrad


def _deferred_column_weight_grads(
    gemms: Gemms,
    x: torch.Tensor,
    group: Any,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    dy: torch.Tensor,
) -> None:
    """W of a column-parallel linear: gather its kept input's sequence shards again (SP:
    `group`), then add dW and db into the main grads."""
    total = x if group is None else _gather_start(x, group).wait()
    _column_weight_grads(gemms, weight, bias, total, dy, dy)


def _deferred_row_weight_grad(
    gemms: Gemms, x: torch.Tensor, group: Any, weight: torch.Tensor, dy: torch.Tensor
) -> None:
    """W of a row-parallel linear: gather its output gradient's sequence shards again (SP:
    `group`; B kept only the shard), then add dW into the main grad."""
    full = dy if group is None else _gather_start(dy, group).wait()
    gemms.weight_grad(weight, None, flat(x), flat(full))


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
    def forward(ctx, x, weight, bias, group, sequence_parallel, rows, pair, float8):
        # Only what the GEMMs keep of x (x itself, or its float8 cast) and their scales are
        # saved: a row-parallel partner may unpack them before this backward runs, and
        # recompute's saved tensors unpack once. The parameters themselves are kept instead
        # (their main grads need the objects; a saved-tensor hook, the memory tracker's, may
        # unpack a saved parameter as another tensor object).
        gemms = gemms_for(
            float8, weight, rows, lambda: column_splits(group, sequence_parallel, float8)
        )
        kept = gemms.keep_input(x)
        ctx.save_for_backward(kept, *gemms.scales())
        ctx.group, ctx.sequence_parallel, ctx.gemms = group, sequence_parallel, gemms
        ctx.weight, ctx.bias, ctx.pair = weight, bias, pair
        ctx.gathered = None  # (the kept input's full sequence, the scales): the partner's (SP)
        if not sequence_parallel:
            return gemms.forward(kept, bias)
        if pair is not None:
            pair.column_ran(ctx)
        product, width = gemms.product(bias), used(weight, rows).shape[0]
        gather = _gather_start(kept, group)
        y, _ = _product_under_gather(kept, gather, group, product, width, x.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        group, sp, gemms = ctx.group, ctx.sequence_parallel, ctx.gemms
        grad_weight, grad_bias = _column_grad_params(ctx)
        queue = _queue(ctx, grad_weight, grad_bias)
        gathered, ctx.gathered = ctx.gathered, None
        if gathered is None:
            x, *scales = ctx.saved_tensors
            total = None
        else:
            (total, scales), x = gathered, None
        gemms.restore(scales)
        grad = gemms.output_grad(dy)  # its amaxes reduced before the gather is in flight
        gather = None
        if sp and queue is None and total is None and grad_weight is not None:
            gather = _gather_start(x, group)
        reduction = None
        if ctx.needs_input_grad[0]:
            dx = gemms.input_grad(grad)
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
            work = (_deferred_column_weight_grads, gemms, x, gather_group, grad_weight, grad_bias)
            queue.put(functools.partial(*work, dy), x, dy)
        else:
            wgrad, bgrad = _column_weight_grads(gemms, grad_weight, grad_bias, total, dy, grad)
        dx = None if reduction is None else reduction.wait()
        return dx, wgrad, bgrad, None, None, None, None, None


def _gather_output_grad(ctx: Any, shard: torch.Tensor) -> comm.Pending:
    """Start gathering the row-parallel output gradient's full sequence (SP). The partner's
    backward will gather its own kept input's shards again; both go in one all-gather (fewer
    collectives, the same bytes) unless the partner has nothing to gather now (no weight
    gradient, or deferred to a W step) or the two travel as different dtypes."""
    partner = ctx.partner
    if partner is not None and partner.gathered is None:
        weight, bias = _column_grad_params(partner)
        if weight is not None and _queue(partner, weight, bias) is None:
            x, *scales = partner.saved_tensors
            if _wire(x).dtype == _wire(shard).dtype:
                both = all_gather_sequence_together_start([_wire(shard), _wire(x)], ctx.group)

                def output_grad() -> torch.Tensor:
                    dy, total = both.wait()
                    partner.gathered = (total.view(x.dtype), scales)
                    return dy.view(shard.dtype)

                return comm.Pending(None, output_grad)
    return _gather_start(shard, ctx.group)


class _RowParallel(torch.autograd.Function):
    """forward: y = x W^T, partial sums reduce-scattered to sequence shards (SP) or all-reduced;
    backward: all-gather dy's sequence shards (SP; with the partner's input, see
    `_gather_output_grad`), dx = dy W, dW = dy^T x."""

    @staticmethod
    def forward(ctx, x, weight, group, sequence_parallel, pair, float8):
        gemms = gemms_for(
            float8, weight, None, lambda: row_splits(group, sequence_parallel, float8)
        )
        kept = gemms.keep_input(x)
        ctx.save_for_backward(kept, weight, *gemms.scales())
        ctx.group, ctx.sequence_parallel, ctx.pair = group, sequence_parallel, pair
        ctx.weight, ctx.gemms = weight, gemms  # the parameter itself (see _ColumnParallel)
        ctx.partner = pair.take_column() if sequence_parallel and pair is not None else None
        if sequence_parallel and comm.size(group) > 1:  # y: partial sums over tp, scattered
            product = gemms.rows_product(kept)
            return _product_then_scatter(kept, group, product, weight.shape[0], x.dtype)
        y = gemms.forward(kept)  # (b, s, out): a partial sum over tp
        comm.all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, shard):
        x, weight, *scales = ctx.saved_tensors
        gemms = ctx.gemms
        gemms.restore(scales)
        gather_group = ctx.group if ctx.sequence_parallel else None
        wants_dx = ctx.needs_input_grad[0]
        grad = gemms.output_grad(shard)
        if gather_group is None:
            full = grad
            dx = gemms.input_grad(full) if wants_dx else None
        elif wants_dx:  # dx = dy W: this rank's tokens while the others' dy is gathered
            gather = _gather_output_grad(ctx, grad)
            product, width = gemms.input_grad_product(), weight.shape[1]
            dx, full = _product_under_gather(grad, gather, ctx.group, product, width, shard.dtype)
        else:
            dx, full = None, _gather_output_grad(ctx, grad).wait()
        ctx.partner = None
        dw = None
        if ctx.needs_input_grad[1]:
            queue = _queue(ctx, ctx.weight)
            if queue is not None:
                work = (_deferred_row_weight_grad, gemms, x, gather_group, ctx.weight, shard)
                queue.put(functools.partial(*work), x, shard)
            else:
                dw = gemms.weight_grad(ctx.weight, None, flat(x), flat(full))
        return dx, dw, None, None, None, None


def traced_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: Rows = None
) -> torch.Tensor:
    """x W[rows]^T + b[rows] by autograd alone, which torch.compile traces: a linear with no
    tensor-parallel peer (tp 1) and no deferred weight gradient needs none of the above. Its
    weight gradient arrives as a `.grad`, which the gradient buffer moves into the fp32 main
    grad (`train.compile` at tp 1: training/compile.py)."""
    return Gemms(weight, rows).forward(x, bias)


@eager_only
def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Rows,
    group: Any,
    sequence_parallel: bool,
    pair: LinearPair | None = None,
    float8: Float8Training | None = None,
) -> torch.Tensor:
    """y = x W[rows]^T + b[rows], x the sequence shard (SP) or the replicated input; y covers
    the full sequence. `pair`: shared with the row-parallel linear after it (None: none, and
    no deferral). `float8`: its GEMMs in float8 (None: in x's dtype)."""
    return _ColumnParallel.apply(x, weight, bias, group, sequence_parallel, rows, pair, float8)


@eager_only
def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any,
    sequence_parallel: bool,
    pair: LinearPair | None = None,
    float8: Float8Training | None = None,
) -> torch.Tensor:
    """x W^T summed over tp: the sequence shard (SP) or the full, replicated result. `pair`:
    shared with the column-parallel linear before it (None: none, and no deferral). `float8`:
    its GEMMs in float8 (None: in x's dtype)."""
    return _RowParallel.apply(x, weight, group, sequence_parallel, pair, float8)
