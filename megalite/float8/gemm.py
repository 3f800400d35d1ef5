"""The float8 GEMM (`torch._scaled_mm`), which GEMMs take it, and which devices have it.

`torch._scaled_mm` runs on CPU in torch 2.13 (any shape, fp32 accumulation), so the tests run
the real float8 path; on CUDA it needs compute capability 8.9 (Ada, Hopper, Blackwell), an
(M, K) row-major first operand and a column-major second, K and N multiples of 16, and, for
rowwise scales below sm90, a 16-bit output. A GEMM that does not fit runs in its compute
dtype; nothing is padded.

Which GEMMs are worth it is decided from the linear's global in and out features, never a
rank's share, so every layout puts the same GEMMs in float8: `train.fp8_min_dim` keeps a linear
whose smaller dim is below it in the compute dtype (torchao's filters skip tensorwise linears
with K <= 4096 and N <= 1024 as slower in float8 on an H100; 1024, the default, is the simpler
rule of that kind).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megalite.errors import ConfigError
from megalite.float8 import takes_float8
from megalite.float8.scaling import RECIPES, Quantised, Recipe, dequantise

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with float8 tensor cores (Ada: L4, L40S)."""
CUDA_ALIGNMENT = 16
"""`_scaled_mm` on CUDA: K and N multiples of 16."""


@dataclass(frozen=True)
class Float8Training:
    """A run's `train.fp8`: the recipe, the smallest dim a float8 GEMM may have, and the groups
    that split a micro-batch's tokens beside SP's (cp), over which activation amaxes are
    reduced."""

    recipe: Recipe
    min_dim: int
    token_groups: tuple[Any, ...] = ()

    def applies(self, in_features: int, out_features: int) -> bool:
        """Whether a linear of these global features runs its GEMMs in float8."""
        return takes_float8(self.min_dim, in_features, out_features)


def float8_training(
    name: str, min_dim: int, device: torch.device, token_groups: Sequence[Any] = ()
) -> Float8Training | None:
    """The run's float8 setting for `train.fp8=name` (None for `none`), refused on a CUDA
    device without float8 GEMMs."""
    if name == "none":
        return None
    require_float8_gemms(device, name)
    return Float8Training(RECIPES[name], min_dim, tuple(token_groups))


def require_float8_gemms(device: torch.device, name: str) -> None:
    """One error naming the device and the fix where `_scaled_mm` cannot run: CUDA below
    compute capability 8.9. CPU (and the meta device the estimator builds on) may."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        major, minor = capability
        raise ConfigError(
            f"train.fp8={name} needs float8 GEMMs (CUDA compute capability 8.9 or newer: L4, "
            f"L40S, H100, H200, B200); {torch.cuda.get_device_name(device)} is sm{major}{minor}: "
            "set train.fp8=none"
        )


def fits(m: int, k: int, n: int, device: torch.device) -> bool:
    """Whether `_scaled_mm` takes an (m, k) x (k, n) product on `device`."""
    del m  # any number of rows
    if device.type != "cuda":
        return True
    return k % CUDA_ALIGNMENT == 0 and n % CUDA_ALIGNMENT == 0


def _output_dtype(a: Quantised, out_dtype: torch.dtype) -> torch.dtype:
    """Rowwise scales on CUDA write 16 bits (torch's CUTLASS rowwise kernel; cuBLAS's fp32
    output needs sm90 and cuBLAS 12.9): then bf16, widened after."""
    if a.data.is_cuda and a.scale.dim() > 0 and out_dtype == torch.float32:
        return torch.bfloat16
    return out_dtype


def _cpu_rowwise(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """On the CPU a tensorwise scale as one per row, all equal: torch 2.13's CPU `_scaled_mm`
    takes singleton scales through a scalar loop (~100x slower at these widths) and per-row
    ones through oneDNN; the product is the same, bit for bit (an exact float8 product times
    the same scales). On CUDA, and for per-row scales, `scale` itself."""
    if scale.is_cuda or scale.dim() > 0:
        return scale
    return scale.expand(rows, 1).contiguous()


def scaled_mm(
    a: Quantised, b: Quantised, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T in `out_dtype` (into `out` where given), each operand scaled by
    its scalar or per-row (rows, 1) scale; both float8, row-major, sharing K. A product
    `_scaled_mm` does not take on the device (`fits`) multiplies the dequantised operands in
    `out_dtype`: the same values, in the compute dtype's GEMM."""
    (m, k), n = a.data.shape, b.data.shape[0]
    if not fits(m, k, n, a.data.device):
        return torch.mm(dequantise(a, out_dtype), dequantise(b, out_dtype).t(), out=out)
    scale_a = _cpu_rowwise(a.scale.reciprocal(), m)
    scale_b = _cpu_rowwise(b.scale.reciprocal(), n)
    if scale_b.dim() > 0:
        scale_b = scale_b.t().contiguous()  # (1, N)
    dtype = _output_dtype(a, out_dtype)
    args = dict(scale_a=scale_a, scale_b=scale_b, out_dtype=dtype)
    if dtype != out_dtype:
        product = torch._scaled_mm(a.data, b.data.t(), **args)
        return product.to(out_dtype) if out is None else out.copy_(product)
    if out is None:
        return torch._scaled_mm(a.data, b.data.t(), **args)
    return torch._scaled_mm(a.data, b.data.t(), **args, out=out)
