"""Rotary position embeddings for q and k in one Triton pass, with the PyTorch reference.

Why fuse: eager rotary builds ``rotate_half(x)`` with a negation and a concatenation, then two
products and a sum, for q and again for k: several full-size temporaries per tensor. The kernel
reads each of q and k once and writes each once, in one launch: one program per token loads
that position's cos/sin row and rotates all q heads and all k heads of the token.

Layout: q (batch, seq, heads, head_dim) and k (batch, seq, kv_heads, head_dim), in the Hugging
Face ``rotate_half`` convention: the two halves of head_dim form the rotation pairs, and the
tables ``cos``/``sin`` are (positions, head_dim) with the first ``seq`` rows used. The kernel
reads q and k through their strides, so the non-contiguous views that attention cuts out of
its fused q/k/v projection are read in place (no copy); the outputs are new contiguous tensors.
Backward is the transposed rotation (by -angle), the same kernel with ``BACKWARD`` set. Math
is fp32 whatever the input dtype.
"""

import torch

from ._triton import tl, triton
from .dispatch import opaque, use_triton

MAX_TILE = 16384  # (heads x head_dim/2) elements one program holds per tensor
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(SRC, stride_h, stride_d, DST, n_heads, HALF, c1, c2, s1, s2,
                  BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotate the (n_heads, 2 * HALF) heads of one token; DST is contiguous."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (d < HALF)
    src = SRC + heads * stride_h + d * stride_d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # first half of each head
    x2 = tl.load(src + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)  # second half
    if BACKWARD:  # the transpose of the forward map below
        out1, out2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        out1, out2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    dst = DST + heads * (2 * HALF) + d
    tl.store(dst, out1.to(DST.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Q_OUT, K_OUT, COS, SIN, S, HQ, HK, HALF, stride_qb, stride_qs,
                   stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd, stride_cos,
                   BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # b * S + s
    b, s = token // S, token % S
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    table = s * stride_cos + d
    c1 = tl.load(COS + table, mask=mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(COS + table + HALF, mask=mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(SIN + table, mask=mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(SIN + table + HALF, mask=mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q + b * stride_qb + s * stride_qs, stride_qh, stride_qd,
                  Q_OUT + token * HQ * 2 * HALF, HQ, HALF, c1, c2, s1, s2, BACKWARD, BLOCK_HQ,
                  BLOCK_HALF)  # fmt: skip
    _rotate_heads(K + b * stride_kb + s * stride_ks, stride_kh, stride_kd,
                  K_OUT + token * HK * 2 * HALF, HK, HALF, c1, c2, s1, s2, BACKWARD, BLOCK_HK,
                  BLOCK_HALF)  # fmt: skip


def _launch(q, k, cos, sin, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (any strides) into new contiguous tensors."""
    (b, s, hq, hd), hk = q.shape, k.shape[2]
    q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    k_out = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    _rotary_kernel[(b * s,)](
        q, k, q_out, k_out, cos, sin, s, hq, hk, hd // 2, *q.stride(), *k.stride(), cos.stride(0),
        backward, triton.next_power_of_2(hq), triton.next_power_of_2(hk),
        triton.next_power_of_2(hd // 2),
    )  # fmt: skip
    return q_out, k_out


class RotaryFunction(torch.autograd.Function):
    """Triton rotary for q and k; saves only the (module buffer) tables."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return *_launch(dq, dk, cos, sin, backward=True), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[: x.shape[1], None, :].to(x.dtype), sin[: x.shape[1], None, :].to(x.dtype)
    return x * cos + rotated * sin


def rotary_embedding_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager PyTorch: ``x * cos + rotate_half(x) * sin`` for q and k, in their dtype."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _unsupported(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> str | None:
    """Why the Triton kernel cannot take these inputs, or None when it can."""
    if q.dtype not in SUPPORTED_DTYPES:
        return f"{q.dtype} inputs"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "cos/sin tables that require grad (the kernel differentiates q and k only)"
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return "cos/sin tables with a strided last dim or different strides"
    half = triton.next_power_of_2(q.shape[-1] // 2)
    if triton.next_power_of_2(max(q.shape[2], k.shape[2])) * half > MAX_TILE:
        return f"{max(q.shape[2], k.shape[2])} heads of size {q.shape[-1]} per token"
    return None


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s, heads, hd) and k (b, s, kv_heads, hd) rotated by position (the first s rows of
    the (positions, hd) tables cos and sin, Hugging Face rotate_half layout); new tensors."""
    b, s, _, hd = q.shape
    if k.ndim != 4 or k.shape[:2] != (b, s) or k.shape[-1] != hd or k.dtype != q.dtype:
        raise ValueError(f"k {k.dtype} {tuple(k.shape)} does not go with q {q.dtype} {q.shape}")
    if hd % 2 or cos.shape != sin.shape or cos.ndim != 2 or cos.shape[1] != hd:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be (positions, {hd}), {hd} even")
    if cos.shape[0] < s:
        raise ValueError(f"sequence of {s} tokens but rotary tables for {cos.shape[0]} positions")
    unsupported = _unsupported(q, k, cos, sin)
    if use_triton(q, k, cos, sin, unsupported=unsupported, fusable=True):
        return opaque(RotaryFunction.apply)(q, k, cos, sin)
    return rotary_embedding_reference(q, k, cos, sin)
