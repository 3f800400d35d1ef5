"""Float8 scales and casts: the recipes, and the dynamic scale of a tensor taken from its amax
over the whole tensor, however many ranks hold pieces of it.

A cast multiplies by a scale and saturates: `q = clamp(t * scale, -max, max)` in float8, with
`scale = max / amax` (torchao's `amax_to_scale`: computed in float64, kept in fp32; an amax
below 1e-12 counts as 1e-12, so a tensor of zeros gets a finite scale and casts to zeros).
`q / scale` is the value a GEMM sees; `torch._scaled_mm` takes the reciprocals.

Layout independence: a tensor split over ranks (tp's weight shards, SP's and cp's token
shards) is scaled by the amax of the whole tensor, each rank's amax MAX-reduced over the groups
that split it (`comm.all_reduce_max`, on the device: no host read). Rowwise, each row's amax
over the dim the GEMM contracts, reduced over the groups that split that dim. So every layout
casts every element exactly as the single process does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from megalite import comm

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FLOAT8_DTYPES = (E4M3, E5M2)
AMAX_FLOOR = 1e-12
"""torchao's EPS: the smallest amax a scale is taken from."""


@dataclass(frozen=True)
class Recipe:
    """Which float8 types and scales the three operands of a linear's GEMMs take (torchao's
    `Float8LinearRecipeName`): activations and weights e4m3; output gradients e5m2
    (tensorwise, the wider range gradients need: torchao's default) or e4m3 (rowwise, whose
    per-row scales already follow the range); rowwise scales rounded down to a power of two,
    so that a cast and its inverse are exact."""

    name: str
    rowwise: bool
    grad_dtype: torch.dtype
    power_of_2: bool
    input_dtype: torch.dtype = E4M3
    weight_dtype: torch.dtype = E4M3


RECIPES = {
    "tensorwise": Recipe("tensorwise", rowwise=False, grad_dtype=E5M2, power_of_2=True),
    "rowwise": Recipe("rowwise", rowwise=True, grad_dtype=E4M3, power_of_2=True),
}


class Quantised(NamedTuple):
    """A float8 tensor and the scale it was cast with: a scalar, or one per row (rows, 1)."""

    data: torch.Tensor
    scale: torch.Tensor


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """`max(dtype) / amax` in fp32 (computed in float64), optionally rounded down to a power
    of two; amax below `AMAX_FLOOR` counts as it."""
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=AMAX_FLOOR)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t * scale` saturated to the range of `dtype` and rounded to it (to nearest even)."""
    limit = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-limit, limit).to(dtype)


def dequantise(q: Quantised, dtype: torch.dtype) -> torch.Tensor:
    """The values a float8 GEMM multiplies, `data / scale`, in `dtype`."""
    return (q.data.float() / q.scale).to(dtype)


def reduce_max(amax: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """`amax` MAX-reduced in place over each group in turn (None: a group of one)."""
    for group in groups:
        comm.all_reduce_max(amax, group)
    return amax


def tensor_amax(t: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """The fp32 amax of the whole tensor whose pieces `groups` hold (t: this rank's piece)."""
    return reduce_max(t.abs().amax().float(), groups)


def row_amax(t: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """(rows, 1) fp32: each row's amax over the last dim, which `groups` split."""
    return reduce_max(t.abs().amax(dim=-1, keepdim=True).float(), groups)


def quantise(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, recipe: Recipe) -> Quantised:
    """`t` cast to `dtype` with the scale of `amax` (a scalar, or (rows, 1) per row of t)."""
    scale = amax_to_scale(amax, dtype, recipe.power_of_2)
    return Quantised(cast(t, scale, dtype), scale)


def tensor_scale(
    t: torch.Tensor, dtype: torch.dtype, recipe: Recipe, groups: Sequence[Any] = ()
) -> torch.Tensor:
    """The one scale of the whole tensor whose pieces `groups` hold (t: this rank's)."""
    return amax_to_scale(tensor_amax(t, groups), dtype, recipe.power_of_2)


def quantise_tensor(
    t: torch.Tensor, dtype: torch.dtype, recipe: Recipe, groups: Sequence[Any] = ()
) -> Quantised:
    """`t` cast with one scale from the amax of the whole tensor (`groups` hold its pieces)."""
    return quantise(t, tensor_amax(t, groups), dtype, recipe)


def quantise_rows(
    t: torch.Tensor, dtype: torch.dtype, recipe: Recipe, groups: Sequence[Any] = ()
) -> Quantised:
    """2-D `t` cast with one scale per row, from its amax over the columns (split by
    `groups`)."""
    return quantise(t, row_amax(t, groups), dtype, recipe)
