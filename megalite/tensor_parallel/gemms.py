"""The three GEMMs of a column- or row-parallel linear, y = x W^T, dx = dy W and dW = dy^T x:
in the compute dtype (`Gemms`), or through `torch._scaled_mm` in float8 (`Float8Gemms`,
`train.fp8`). `linear.py` owns the communication and its overlap and calls these for the
products, so both run under exactly the same collectives.

Float8 (torchao's recipes, `float8.scaling`): x and W in e4m3, dy in e5m2 (tensorwise) or e4m3
(rowwise); the products come out in the compute dtype, dW in fp32 for the main grad.
- tensorwise: one scale per tensor, the amax of the whole tensor. The linear keeps its input as
  float8 (1 byte per element, plus its scale and the weight's) in place of the compute-dtype
  copy, gathers it in float8 under SP (the scale is already every rank's), reuses it for dW,
  and casts the output gradient once for dx and dW. The weight is cast again in backward with
  the scale its forward took: no fp8 weight is held between them.
- rowwise: per-row scales along each GEMM's contracted dim: x and W per row of K in forward;
  dy per token and W per column over N for dx; dy and x per column over the tokens for dW.
  Each operand is cast for the GEMM it is in (torchao's axiswise casts), so the linear keeps
  its input in the compute dtype, as torchao does, and SP gathers that.

Which ranks hold pieces of each operand (`Splits`) decides which groups an amax is reduced
over: tp splits the weight (column: its rows, N; row: its columns, K), and with them a
column's output gradient or a row's input along that dim; SP splits the tokens a column
receives and a row's output gradient; cp splits every tensor's tokens. Data parallel ranks
hold other micro-batches, each the single process's own, so no amax is reduced over dp; nor
over pp, which splits no tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megalite.float8.gemm import Float8Training, scaled_mm
from megalite.float8.scaling import (
    FLOAT8_DTYPES,
    Quantised,
    Recipe,
    cast,
    quantise_rows,
    quantise_tensor,
    tensor_scale,
)

Rows = tuple[slice, ...] | None
"""The rows of a weight a linear computes, in order (q and a shared kv head of a fused q/k/v:
`ColumnOutput.shared_heads`); None: all."""

Product = Callable[[torch.Tensor, torch.Tensor], Any]
"""A GEMM of a linear's tokens: `product(a, out)` writes a (tokens, in) @ M into `out`."""

RowsProduct = Callable[[slice, torch.Tensor], Any]
"""A GEMM of some of a linear's tokens: `product(rows, out)` writes the input's flat tokens
`rows` times M into `out`."""


def used(weight: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
    """The rows computed: the weight itself, a view, or (a shared kv head beside q) a copy of
    the rows, one weight-sized copy that keeps the product one GEMM."""
    if weight is None or rows is None:
        return weight
    if len(rows) == 1:
        return weight[rows[0]]
    return torch.cat([weight[piece] for piece in rows])


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def times(matrix: torch.Tensor, bias: torch.Tensor | None = None) -> Product:
    """The product a @ matrix (+ bias)."""
    if bias is None:
        return lambda a, out: torch.mm(a, matrix, out=out)
    return lambda a, out: torch.addmm(bias, a, matrix, out=out)


def _into_rows(weight: torch.Tensor, rows: Rows, grad: torch.Tensor) -> torch.Tensor:
    """A gradient of the weight's `rows` (in order) as one of the whole weight."""
    if rows is None:
        return grad
    full, start = grad.new_zeros(weight.shape), 0
    for piece in rows:
        end = start + piece.stop - piece.start
        full[piece] = grad[start:end]
        start = end
    return full


def weight_grad(
    weight: torch.Tensor, rows: Rows, x: torch.Tensor | None, dy: torch.Tensor
) -> torch.Tensor | None:
    """dW = dy^T x for x (tokens, in), dy (tokens, out); a bias's gradient (x None) sums dy over
    the tokens. Added into the fp32 main grad when the parameter has one (None is returned:
    autograd makes no `.grad`), else returned."""
    accumulate = getattr(weight, "accumulate_main_grad", None)
    if accumulate is not None:
        accumulate(dy, x, rows)
        return None
    return _into_rows(weight, rows, dy.sum(0) if x is None else dy.t() @ x)


def add_weight_grad(weight: torch.Tensor, rows: Rows, grad: torch.Tensor) -> torch.Tensor | None:
    """A weight gradient computed elsewhere (fp32, the weight's `rows`), added into the main
    grad through the same `accumulate_main_grad` as a bias's: as the sum of one token's
    gradient, (1, out, in) summed over that token. Else returned, in the weight's dtype."""
    accumulate = getattr(weight, "accumulate_main_grad", None)
    if accumulate is not None:
        accumulate(grad.unsqueeze(0), None, rows)
        return None
    return _into_rows(weight, rows, grad.to(weight.dtype))


class Gemms:
    """The linear's GEMMs in the compute dtype: what it keeps is its input itself."""

    def __init__(self, weight: torch.Tensor, rows: Rows = None) -> None:
        self.weight, self.rows = weight, rows

    def keep_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the linear keeps for backward, and gathers under SP, in place of its input."""
        return x

    def scales(self) -> tuple[torch.Tensor, ...]:
        """Tensors its backward needs besides the kept input (saved with it)."""
        return ()

    def restore(self, scales: Sequence[torch.Tensor]) -> None:
        """Take back `scales()` in backward."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W[rows]^T (+ b[rows]) for the kept input x (b, s, in)."""
        return F.linear(x, used(self.weight, self.rows), used(bias, self.rows))

    def product(self, bias: torch.Tensor | None = None) -> Product:
        """x W[rows]^T (+ b[rows]) of some of the kept input's tokens."""
        return times(used(self.weight, self.rows).t(), used(bias, self.rows))

    def rows_product(self, x: torch.Tensor) -> RowsProduct:
        """x W^T of some of the kept input x's flat tokens (rows)."""
        flat_x, weight_t = flat(x), self.weight.t()
        return lambda rows, out: torch.mm(flat_x[rows], weight_t, out=out)

    def output_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """What dx and dW take of dy (and SP gathers, for a row-parallel linear)."""
        return dy

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """dx = dy W[rows]."""
        return grad @ used(self.weight, self.rows)

    def input_grad_product(self) -> Product:
        """dy W of some of the output gradient's tokens."""
        return times(self.weight)

    def weight_grad(
        self, weight: torch.Tensor, rows: Rows, x: torch.Tensor, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """dW = dy^T x of the kept input x and the output gradient (tokens, out), or what
        `output_grad` made of it; into the main grad as `weight_grad` does."""
        return weight_grad(weight, rows, x, grad)

    def bias_grad(self, bias: torch.Tensor, dy: torch.Tensor) -> torch.Tensor | None:
        """db: dy (tokens, out) summed over the tokens, in the compute dtype's precision."""
        return weight_grad(bias, self.rows, None, dy)


@dataclass(frozen=True)
class Splits:
    """The groups holding pieces of each operand of one linear's GEMMs: an amax is reduced
    over them (None: a group of one)."""

    input: tuple[Any, ...]
    """The input as the linear receives it (a column's SP shard; cp's tokens; a row's K)."""
    output_grad: tuple[Any, ...]
    """The output gradient as the linear receives it (a row's SP shard; a column's N)."""
    weight: tuple[Any, ...]
    """The weight: tp."""
    in_features: tuple[Any, ...]
    """K: tp for a row-parallel linear."""
    out_features: tuple[Any, ...]
    """N: tp for a column-parallel linear."""
    tokens: tuple[Any, ...]
    """The tokens of a gathered input or output gradient (dW's contracted dim): cp."""


def column_splits(tp: Any, sequence_parallel: bool, float8: Float8Training) -> Splits:
    """A column-parallel linear's: N split over tp; its input a sequence shard under SP."""
    cp = float8.token_groups
    shard = (tp,) if sequence_parallel else ()
    return Splits(shard + cp, (tp, *cp), (tp,), (), (tp,), cp)


def row_splits(tp: Any, sequence_parallel: bool, float8: Float8Training) -> Splits:
    """A row-parallel linear's: K split over tp; its output gradient a shard under SP."""
    cp = float8.token_groups
    shard = (tp,) if sequence_parallel else ()
    return Splits((tp, *cp), shard + cp, (tp,), (tp,), (), cp)


class Float8Gemms(Gemms):
    """The linear's GEMMs through `torch._scaled_mm` (see the module docstring)."""

    def __init__(self, recipe: Recipe, splits: Splits, weight: torch.Tensor, rows: Rows) -> None:
        super().__init__(weight, rows)
        self.recipe, self.splits = recipe, splits
        self.dtype = weight.dtype  # the compute dtype the products come out in
        self.input_scale = self.weight_scale = self.grad_scale = None  # tensorwise
        self._dx_operands: tuple[Quantised, Quantised] | None = None  # rowwise, cast early

    # ---------------------------------------------------------------- forward

    def keep_input(self, x: torch.Tensor) -> torch.Tensor:
        self.dtype = x.dtype
        if self.recipe.rowwise:
            return x
        recipe = self.recipe
        self.weight_scale = tensor_scale(
            self.weight, recipe.weight_dtype, recipe, self.splits.weight
        )
        kept = quantise_tensor(x, self.recipe.input_dtype, self.recipe, self.splits.input)
        self.input_scale = kept.scale
        return kept.data

    def scales(self) -> tuple[torch.Tensor, ...]:
        return () if self.recipe.rowwise else (self.input_scale, self.weight_scale)

    def restore(self, scales: Sequence[torch.Tensor]) -> None:
        if not self.recipe.rowwise:
            self.input_scale, self.weight_scale = scales

    def _weight(self) -> Quantised:
        """W[rows] (out, in) for y: one scale, or one per row over K."""
        w, dtype = used(self.weight, self.rows), self.recipe.weight_dtype
        if self.recipe.rowwise:
            return quantise_rows(w, dtype, self.recipe, self.splits.in_features)
        return Quantised(cast(w, self.weight_scale, dtype), self.weight_scale)

    def _input(self, x: torch.Tensor, groups: Sequence[Any]) -> Quantised:
        """Tokens (n, in) of the kept input as y's first operand (rowwise: K split by
        `groups`)."""
        if self.recipe.rowwise:
            return quantise_rows(x, self.recipe.input_dtype, self.recipe, groups)
        return Quantised(x, self.input_scale)

    def _product(
        self, a: Quantised, b: Quantised, out: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        scaled_mm(a, b, self.dtype, out)
        return out if bias is None else out.add_(bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat_x, w8 = self._input(flat(x), self.splits.in_features), self._weight()
        y = torch.empty((flat_x.data.shape[0], w8.data.shape[0]), dtype=self.dtype, device=x.device)
        self._product(flat_x, w8, y, used(bias, self.rows))
        return y.view(*x.shape[:-1], -1)

    def product(self, bias: torch.Tensor | None = None) -> Product:
        assert not self.splits.in_features, "pieces are cast alone: K must be whole"
        w8, bias = self._weight(), used(bias, self.rows)
        return lambda a, out: self._product(self._input(a, ()), w8, out, bias)

    def rows_product(self, x: torch.Tensor) -> RowsProduct:
        x8, w8 = self._input(flat(x), self.splits.in_features), self._weight()

        def product(rows: slice, out: torch.Tensor) -> torch.Tensor:
            scale = x8.scale if x8.scale.dim() == 0 else x8.scale[rows]
            return self._product(Quantised(x8.data[rows], scale), w8, out, None)

        return product

    # ---------------------------------------------------------------- backward

    def output_grad(self, dy: torch.Tensor) -> torch.Tensor:
        if self.recipe.rowwise:
            if self.splits.out_features:  # dx's casts reduce over tp: before any gather starts
                self._dx_operands = (
                    self._grad(flat(dy), self.splits.out_features),
                    self._weight_t(),
                )
            return dy
        grad = quantise_tensor(dy, self.recipe.grad_dtype, self.recipe, self.splits.output_grad)
        self.grad_scale = grad.scale
        return grad.data

    def _grad(self, grad: torch.Tensor, groups: Sequence[Any]) -> Quantised:
        """Tokens (n, out) of `output_grad`'s result as dx's first operand (rowwise: N split
        by `groups`)."""
        if self.recipe.rowwise:
            return quantise_rows(grad, self.recipe.grad_dtype, self.recipe, groups)
        return Quantised(grad, self.grad_scale)

    def _weight_t(self) -> Quantised:
        """W[rows]^T (in, out) for dx: the forward's scale, or one per column over N."""
        w_t, dtype = used(self.weight, self.rows).t().contiguous(), self.recipe.weight_dtype
        if self.recipe.rowwise:
            return quantise_rows(w_t, dtype, self.recipe, self.splits.out_features)
        return Quantised(cast(w_t, self.weight_scale, dtype), self.weight_scale)

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        operands, self._dx_operands = self._dx_operands, None
        if operands is None:
            operands = (self._grad(flat(grad), self.splits.out_features), self._weight_t())
        dx = scaled_mm(*operands, self.dtype)
        return dx.view(*grad.shape[:-1], -1)

    def input_grad_product(self) -> Product:
        assert not self.splits.out_features, "pieces are cast alone: N must be whole"
        w_t = self._weight_t()
        return lambda a, out: scaled_mm(self._grad(a, ()), w_t, self.dtype, out)

    def weight_grad(
        self, weight: torch.Tensor, rows: Rows, x: torch.Tensor, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """dW in fp32 from the kept input and the output gradient: its float8 cast, or dy
        itself (a deferred W step recasts it with the scale B took; rowwise casts dy here)."""
        recipe, tokens = self.recipe, self.splits.tokens
        if recipe.rowwise:
            dy_t = quantise_rows(grad.t().contiguous(), recipe.grad_dtype, recipe, tokens)
            x_t = quantise_rows(x.t().contiguous(), recipe.input_dtype, recipe, tokens)
        else:
            if grad.dtype not in FLOAT8_DTYPES:
                grad = cast(grad, self.grad_scale, recipe.grad_dtype)
            dy_t = Quantised(grad.t().contiguous(), self.grad_scale)
            x_t = Quantised(x.t().contiguous(), self.input_scale)
        return add_weight_grad(weight, rows, scaled_mm(dy_t, x_t, torch.float32))


def gemms_for(
    float8: Float8Training | None,
    weight: torch.Tensor,
    rows: Rows,
    splits: Callable[[], Splits],
) -> Gemms:
    """A linear call's GEMMs: in float8 when the layer was given a setting (`float8`), with
    the groups `splits()` names; else in the compute dtype."""
    if float8 is None:
        return Gemms(weight, rows)
    return Float8Gemms(float8.recipe, splits(), weight, rows)
