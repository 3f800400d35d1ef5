"""Fused bias + GELU (tanh approximation) in Triton, with its PyTorch reference.

Why fuse: in eager mode ``gelu(x + bias)`` reads and writes the (tokens, ffn_hidden) tensor
twice and keeps both ``x + bias`` and the output alive for backward. The kernel reads x once,
writes the output once, and backward recomputes ``x + bias`` from the saved inputs. The bias
gradient is reduced inside the backward kernel: each program writes the fp32 column sums of
its row tile, and a tiny (row_tiles, hidden) sum finishes it, so there are no atomics.

x is viewed as (rows, hidden) with the bias along the last dim; a 2D grid of tiles masks the
ragged edges. All math is fp32 whatever the input dtype (loads are widened first, which also
keeps bf16 honest under the Triton interpreter).
"""

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .dispatch import opaque, use_triton

BLOCK_M, BLOCK_N = 32, 128  # a (rows, hidden) tile per program


@triton.jit
def _gelu_tanh(u):
    """tanh(sqrt(2/pi) * (u + 0.044715 u^3)), the gate of tanh-GELU: gelu(u) = u (1 + t) / 2."""
    z = 0.7978845608028654 * (u + 0.044715 * u * u * u)
    # tanh(z) from exp(-2|z|) <= 1, which cannot overflow; tl has no portable tanh
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t)


@triton.jit
def _tile(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    return rows[:, None] * N + cols[None, :], cols, mask


@triton.jit
def _bias_gelu_fwd_kernel(X, BIAS, OUT, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs, cols, mask = _tile(tl.program_id(0), tl.program_id(1), M, N, BLOCK_M, BLOCK_N)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    u = x + tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    t = _gelu_tanh(u)
    tl.store(OUT + offs, (0.5 * u * (1.0 + t)).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, X, BIAS, DX, DBIAS_PARTIAL, M, N, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    offs, cols, mask = _tile(pid_m, tl.program_id(1), M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    u = x + tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    t = _gelu_tanh(u)
    dt_du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * u * u) * (1.0 - t * t)
    dx = dy * (0.5 * (1.0 + t) + 0.5 * u * dt_du)  # masked entries are 0: dy was loaded as 0
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DBIAS_PARTIAL + pid_m * N + cols, tl.sum(dx, axis=0), mask=cols < N)


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)


class BiasGeluFunction(torch.autograd.Function):
    """Triton bias-GELU; saves only x and bias for backward."""

    @staticmethod
    def forward(ctx, x, bias):
        x2d, bias = x.contiguous().view(-1, x.shape[-1]), bias.contiguous()  # (rows, hidden)
        out = torch.empty(x2d.shape, device=x.device, dtype=torch.result_type(x, bias))
        _bias_gelu_fwd_kernel[_grid(*x2d.shape)](x2d, bias, out, *x2d.shape, BLOCK_M, BLOCK_N)
        ctx.save_for_backward(x2d, bias)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dout):
        x2d, bias = ctx.saved_tensors
        m, n = x2d.shape
        grid = _grid(m, n)
        dx = torch.empty_like(x2d)
        partial = torch.empty((grid[0], n), device=x2d.device, dtype=torch.float32)
        dy = dout.contiguous().view(m, n)
        _bias_gelu_bwd_kernel[grid](dy, x2d, bias, dx, partial, m, n, BLOCK_M, BLOCK_N)
        return dx.view(dout.shape), partial.sum(0).to(bias.dtype)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Eager PyTorch: ``gelu(x + bias)`` with the tanh approximation."""
    return F.gelu(x + bias, approximate="tanh")


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x + bias, approximate="tanh")``; bias (hidden,) broadcasts over x (..., hidden)."""
    if bias.ndim != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias {tuple(bias.shape)} must be (x.shape[-1],) for x {tuple(x.shape)}")
    if use_triton(x, bias, fusable=True):
        return opaque(BiasGeluFunction.apply)(x, bias)
    return bias_gelu_reference(x, bias)
