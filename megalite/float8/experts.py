"""The experts' grouped GEMMs in float8: y[rows of g] = x[rows of g] W_g^T, dx and dW, each
operand cast as the recipe says with layout-independent scales, then multiplied by the grouped
GEMM (`kernels.grouped_mm`) on the cast values, dequantised into the compute dtype.

Why dequantised: `torch._scaled_grouped_mm`, the float8 grouped kernel, runs only on CUDA
(sm90+), so the CPU could not run it and no test could hold it to the single process. The cast
values are what a float8 kernel multiplies; their products are exact in fp32 and the sums
accumulate in fp32, as the float8 kernel's do. So the experts train with float8's numerics in
every layout, but without its speed: that kernel is the step after this one.

What "the whole tensor" is for an expert GEMM: the single process runs each micro-batch's
routed rows through the experts on their own. Under expert parallelism an ep rank's experts
receive rows of every ep rank's micro-batch (each one of the single process's micro-batches),
so every row carries its source (`ExpertRows`), and a tensorwise scale is one per source: the
amax over that source's rows, MAX-reduced over the ep ranks holding the rest of them (and over
cp, whose ranks hold the micro-batch's other tokens, and tp where it splits the features).
Rowwise scales are per row (per token) or, for dW, per feature over the rows of one (expert,
source) segment, the rows the single process's GEMM for that expert contracts. Rows computed
only to be dropped (a capacity at ep 1) have a source of their own, so they scale nothing
else. The weights of a layer's experts (one parameter per kind) are one tensor: one scale over
every expert (tp, ep), or per (expert, row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megalite.float8.scaling import Quantised, Recipe, amax_to_scale, cast, dequantise, reduce_max
from megalite.kernels import grouped_mm, grouped_weight_grad


@dataclass(frozen=True)
class ExpertRows:
    """Where an expert GEMM's rows come from: `source` (rows,) int64, the ep rank whose
    micro-batch each row is of, `sources` for a row that is dropped; None: all of this rank's
    micro-batch. `group`: the ep group (None at ep 1)."""

    source: torch.Tensor | None
    sources: int = 1
    group: Any = None


@dataclass(frozen=True)
class ExpertSplits:
    """The groups splitting an expert GEMM's operands besides ep: `tokens` (cp: the
    micro-batch's other tokens), `in_features` (K: tp for down), `out_features` (N: tp for
    gate/up), `weight` (every piece of the experts' weights: tp, ep)."""

    tokens: tuple[Any, ...]
    in_features: tuple[Any, ...]
    out_features: tuple[Any, ...]
    weight: tuple[Any, ...]


def _segment_amax(t: torch.Tensor, segment: torch.Tensor | None, segments: int) -> torch.Tensor:
    """(segments, 1): the amax of each segment's rows of `t` (rows, features)."""
    rows = t.abs().amax(dim=-1).float()
    if segment is None:
        return rows.amax().reshape(1, 1)
    out = rows.new_zeros(segments)
    return out.scatter_reduce(0, segment, rows, "amax").unsqueeze(1)


def _per_source(
    t: torch.Tensor, rows: ExpertRows, dtype: torch.dtype, recipe: Recipe, groups: Sequence[Any]
) -> Quantised:
    """`t` cast with its source's tensorwise scale on every row (rows, 1)."""
    amax = _segment_amax(t, rows.source, rows.sources + 1)
    scale = amax_to_scale(reduce_max(amax, (rows.group, *groups)), dtype, recipe.power_of_2)
    row_scale = scale.expand(t.shape[0], 1) if rows.source is None else scale[rows.source]
    return Quantised(cast(t, row_scale, dtype), row_scale)


def _per_row(
    t: torch.Tensor, dtype: torch.dtype, recipe: Recipe, dim: int, groups: Sequence[Any]
) -> Quantised:
    """`t` cast with one scale per slice along `dim` (its amax over `dim`, split by
    `groups`)."""
    amax = reduce_max(t.abs().amax(dim=dim, keepdim=True).float(), groups)
    scale = amax_to_scale(amax, dtype, recipe.power_of_2)
    return Quantised(cast(t, scale, dtype), scale)


def _per_segment_column(
    t: torch.Tensor,
    segment: torch.Tensor,
    segments: int,
    dtype: torch.dtype,
    recipe: Recipe,
    groups: Sequence[Any],
) -> Quantised:
    """`t` (rows, features) cast with one scale per (segment, feature): dW's operands, whose
    contraction runs over a segment's rows."""
    index = segment.unsqueeze(1).expand_as(t)
    amax = t.new_zeros((segments, t.shape[1]), dtype=torch.float32)
    amax = reduce_max(amax.scatter_reduce(0, index, t.abs().float(), "amax"), groups)
    scale = amax_to_scale(amax, dtype, recipe.power_of_2)[segment]
    return Quantised(cast(t, scale, dtype), scale)


class _Float8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, rows, splits, recipe):
        ctx.rows, ctx.splits, ctx.recipe = rows, splits, recipe
        if recipe.rowwise:
            x_q = _per_row(x, recipe.input_dtype, recipe, -1, splits.in_features)
            w_q = _per_row(weight, recipe.weight_dtype, recipe, -1, splits.in_features)
            ctx.save_for_backward(x, weight, counts)
        else:
            input_groups = (*splits.tokens, *splits.in_features)
            x_q = _per_source(x, rows, recipe.input_dtype, recipe, input_groups)
            amax = reduce_max(weight.abs().amax().float(), splits.weight)
            w_scale = amax_to_scale(amax, recipe.weight_dtype, recipe.power_of_2)
            w_q = Quantised(cast(weight, w_scale, recipe.weight_dtype), w_scale)
            ctx.save_for_backward(x, weight, counts, x_q.scale, w_scale)
        return grouped_mm(dequantise(x_q, x.dtype), dequantise(w_q, x.dtype), counts)

    @staticmethod
    def backward(ctx, dy):
        rows, splits, recipe = ctx.rows, ctx.splits, ctx.recipe
        x, weight, counts, *scales = ctx.saved_tensors
        dtype, grad_groups = dy.dtype, (*splits.tokens, *splits.out_features)
        if recipe.rowwise:
            dy_q = _per_row(dy, recipe.grad_dtype, recipe, -1, splits.out_features)
            w_q = _per_row(weight, recipe.weight_dtype, recipe, 1, splits.out_features)
        else:
            x_scale, w_scale = scales
            dy_q = _per_source(dy, rows, recipe.grad_dtype, recipe, grad_groups)
            w_q = Quantised(cast(weight, w_scale, recipe.weight_dtype), w_scale)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_t = dequantise(w_q, dtype).transpose(1, 2).contiguous()  # (groups, in, out)
            dx = grouped_mm(dequantise(dy_q, dtype), w_t, counts)
        if ctx.needs_input_grad[1]:
            if recipe.rowwise:
                segment, segments = _segments(counts, rows, x.shape[0])
                cut = (segment, segments)
                dy_q = _per_segment_column(dy, *cut, recipe.grad_dtype, recipe, splits.tokens)
                x_q = _per_segment_column(x, *cut, recipe.input_dtype, recipe, splits.tokens)
            else:
                x_q = Quantised(cast(x, x_scale, recipe.input_dtype), x_scale)
            dw = grouped_weight_grad(dequantise(dy_q, dtype), dequantise(x_q, dtype), counts)
        return dx, dw, None, None, None, None


def _segments(counts: torch.Tensor, rows: ExpertRows, n: int) -> tuple[torch.Tensor, int]:
    """(segment of every row, how many there are): its (expert, source) pair."""
    groups = counts.numel()
    expert = torch.repeat_interleave(
        torch.arange(groups, device=counts.device), counts.long(), output_size=n
    )
    if rows.source is None:
        return expert, groups
    return expert * (rows.sources + 1) + rows.source, groups * (rows.sources + 1)


def float8_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    rows: ExpertRows,
    splits: ExpertSplits,
    recipe: Recipe,
) -> torch.Tensor:
    """`grouped_mm(x, weight, counts)` with each GEMM's operands cast to float8 by `recipe`
    (see the module docstring); x (rows, in) sorted by group, weight (groups, out, in)."""
    return _Float8GroupedMM.apply(x, weight, counts, rows, splits, recipe)
