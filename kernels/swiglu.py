"""Fused SwiGLU, ``silu(gate) * up``, in Triton, with its PyTorch reference.

Why fuse: eager SwiGLU writes ``silu(gate)`` as a temporary and keeps it for backward besides
gate and up. The kernel reads gate and up once and writes the product once; backward recomputes
the sigmoid from the saved inputs and writes both gradients in one pass. Elementwise over the
flattened tensors (1D grid, masked tail), fp32 math whatever the input dtype.
"""

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .dispatch import opaque, use_triton

BLOCK = 1024  # elements per program


@triton.jit
def _sigmoid(x):
    """sigmoid from exp(-|x|) <= 1, so large |x| cannot overflow."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _swiglu_fwd_kernel(GATE, UP, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (g * _sigmoid(g) * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    sig = _sigmoid(g)
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DGATE + offs, dgate.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, (dy * g * sig).to(DUP.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    """Triton SwiGLU; saves only gate and up for backward."""

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty(gate.shape, device=gate.device, dtype=torch.result_type(gate, up))
        n = gate.numel()
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        grid = (triton.cdiv(n, BLOCK),)
        _swiglu_bwd_kernel[grid](dout.contiguous(), gate, up, dgate, dup, n, BLOCK)
        return dgate, dup


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Eager PyTorch: ``silu(gate) * up``."""
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for two tensors of the same shape (..., ffn_hidden)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match")
    if use_triton(gate, up, fusable=True):
        return opaque(SwiGLUFunction.apply)(gate, up)
    return swiglu_reference(gate, up)
