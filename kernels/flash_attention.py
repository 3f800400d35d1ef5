"""FlashAttention-2 style attention in Triton, with its PyTorch reference.

Why a kernel: plain attention materialises the (seq x seq) score matrix per head, which is the
``5*a*s/h`` term of the activation-memory formula in DESIGN.md. Here each program holds one
block of query rows, streams key/value blocks through an online softmax, and saves only the
output and the per-row log-sum-exp for backward. Backward recomputes the probabilities block by
block: a preprocess kernel computes ``delta = rowsum(dO * O)``, one kernel produces dK/dV (one
program per key block, looping over the query blocks and over the query heads of its GQA
group, so no atomics and no repeated K/V), and one produces dQ.

Layout is the model's: q (batch, seq, n_heads, head_dim), k/v (batch, seq, n_kv_heads,
head_dim); the kernels index with strides, so no transpose copies. Query head ``h`` uses key
head ``h // (n_heads // n_kv_heads)``, as ``repeat_interleave`` and SDPA's ``enable_gqa`` do.

Under the Triton interpreter bf16 values are held as raw integers, so the kernels widen every
load to fp32 there (``UPCAST``); products are still rounded to the input dtype before each
``tl.dot`` so interpreter tests see the same rounding as a GPU.
"""

import math

import torch
import torch.nn.functional as F

from ._triton import INTERPRETED_AT_IMPORT, tl, triton
from .autotune import autotune
from .dispatch import opaque, use_triton

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E): exp2 is the fast one


# Tiles each kernel autotunes over, (BLOCK_M, BLOCK_N, num_warps, num_stages): tensor-core
# tiles for 16-bit inputs, and small two-stage ones for fp32's FMA dots, pruned by head size
# (`autotune`). The dK/dV and dQ kernels keep four (BLOCK x HEAD_DIM) fp32 tiles live, so their
# larger ieee tiles take 8 warps.
FWD_TILES = (
    [(128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4)],
    [(64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)],
)
DKDV_TILES = (
    [(32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)],
    [(64, 64, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2)],
)
DQ_TILES = (
    [(128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3)],
    [(64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2)],
)


@triton.jit
def _cast(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Round to the input dtype (what tensor cores consume); widen to fp32 if interpreted."""
    x = x.to(DTYPE)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_tile(head_ptr, rows, stride_s, S, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr,
               UPCAST: tl.constexpr):  # fmt: skip
    """(len(rows), HEAD_DIM) tile of one head; rows past the sequence read as zeros."""
    offs_d = tl.arange(0, HEAD_DIM)
    tile = tl.load(head_ptr + rows[:, None] * stride_s + offs_d[None, :], mask=rows[:, None] < S,
                   other=0.0)  # fmt: skip
    return _cast(tile, DTYPE, UPCAST)


@triton.jit
def _store_tile(head_ptr, rows, stride_s, S, tile, HEAD_DIM: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = head_ptr + rows[:, None] * stride_s + offs_d[None, :]
    tl.store(ptrs, tile.to(head_ptr.dtype.element_ty), mask=rows[:, None] < S)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_head, v_head, stride_ks, stride_vs, offs_m, lo, hi, S,
               qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Online softmax over key blocks [lo, hi); only MASKED blocks pay for the mask."""
    DTYPE: tl.constexpr = k_head.dtype.element_ty
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_head, cols, stride_ks, S, HEAD_DIM, DTYPE, UPCAST)  # (BLOCK_N, D)
        v = _load_tile(v_head, cols, stride_vs, S, HEAD_DIM, DTYPE, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            valid = cols[None, :] < S
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every row sees key 0 first
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(_cast(p, DTYPE, UPCAST), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@autotune(*FWD_TILES)
@triton.jit
def _fwd_kernel(Q, K, V, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
                stride_kh, stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                H, GROUP, S, sm_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """Output rows [start_m, start_m + BLOCK_M) of one (batch, head), plus their LSE."""
    pid_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = pid_bh // H, pid_bh % H
    off_kh = off_h // GROUP  # GQA: the kv head this query head reads
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_head = Q + off_b * stride_qb + off_h * stride_qh
    k_head = K + off_b * stride_kb + off_kh * stride_kh
    v_head = V + off_b * stride_vb + off_kh * stride_vh
    q = _load_tile(q_head, offs_m, stride_qs, S, HEAD_DIM, Q.dtype.element_ty, UPCAST)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # unnormalised output
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max
    qk_scale = sm_scale * LOG2E
    # Key blocks left of the diagonal (causal) or before the ragged tail need no mask; the
    # diagonal / tail blocks do; causal blocks right of the diagonal are skipped entirely.
    if CAUSAL:
        mid, hi = start_m, tl.minimum(start_m + BLOCK_M, S)
    else:
        mid, hi = (S // BLOCK_N) * BLOCK_N, S
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_head, v_head, stride_ks, stride_vs, offs_m,
                               0, mid, S, qk_scale, False, CAUSAL, BLOCK_N, HEAD_DIM, UPCAST,
                               PRECISION)  # fmt: skip
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_head, v_head, stride_ks, stride_vs, offs_m,
                               mid, hi, S, qk_scale, True, CAUSAL, BLOCK_N, HEAD_DIM, UPCAST,
                               PRECISION)  # fmt: skip

    o_head = OUT + off_b * stride_ob + off_h * stride_oh
    _store_tile(o_head, offs_m, stride_os, S, acc / l_i[:, None], HEAD_DIM)
    # base-2 log-sum-exp of the scaled scores: all backward needs to rebuild the probabilities
    tl.store(LSE + pid_bh * S + offs_m, m_i + tl.log2(l_i), mask=offs_m < S)


@triton.jit
def _bwd_preprocess(OUT, DO, DELTA, stride_ob, stride_os, stride_oh, stride_dob, stride_dos,
                    stride_doh, H, S, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """delta = rowsum(dO * O): the softmax-backward correction term, one float per row."""
    pid_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = pid_bh // H, pid_bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_head = OUT + off_b * stride_ob + off_h * stride_oh
    do_head = DO + off_b * stride_dob + off_h * stride_doh
    o = _load_tile(o_head, offs_m, stride_os, S, HEAD_DIM, tl.float32, False)
    do = _load_tile(do_head, offs_m, stride_dos, S, HEAD_DIM, tl.float32, False)
    tl.store(DELTA + pid_bh * S + offs_m, tl.sum(o * do, axis=1), mask=offs_m < S)


@autotune(*DKDV_TILES)
@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, stride_qb, stride_qs, stride_qh,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh,
                     H, H_KV, GROUP, S, sm_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):  # fmt: skip
    """dK, dV of key rows [start_n, start_n + BLOCK_N) of one kv head, summed over its group."""
    pid_bh = tl.program_id(1).to(tl.int64)
    off_b, off_kh = pid_bh // H_KV, pid_bh % H_KV
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    DTYPE: tl.constexpr = Q.dtype.element_ty
    k = _load_tile(K + off_b * stride_kb + off_kh * stride_kh, offs_n, stride_ks, S, HEAD_DIM,
                   DTYPE, UPCAST)  # fmt: skip
    v = _load_tile(V + off_b * stride_vb + off_kh * stride_vh, offs_n, stride_vs, S, HEAD_DIM,
                   DTYPE, UPCAST)  # fmt: skip
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0  # earlier queries cannot see these keys
    for g in range(GROUP):
        off_h = off_kh * GROUP + g
        q_head = Q + off_b * stride_qb + off_h * stride_qh
        do_head = DO + off_b * stride_dob + off_h * stride_doh
        stats_offset = (off_b * H + off_h) * S
        for start_m in range(lo, S, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            rows = offs_m < S
            q = _load_tile(q_head, offs_m, stride_qs, S, HEAD_DIM, DTYPE, UPCAST)  # (BLOCK_M, D)
            do = _load_tile(do_head, offs_m, stride_dos, S, HEAD_DIM, DTYPE, UPCAST)
            lse = tl.load(LSE + stats_offset + offs_m, mask=rows, other=0.0)
            delta = tl.load(DELTA + stats_offset + offs_m, mask=rows, other=0.0)
            # scores transposed, (BLOCK_N, BLOCK_M), so dK and dV come out as (BLOCK_N, D)
            qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
            valid = rows[None, :]
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(valid, tl.exp2(qk_t - lse[None, :]), 0.0)
            dv += tl.dot(_cast(p_t, DTYPE, UPCAST), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])  # softmax backward, transposed
            dk += tl.dot(_cast(ds_t, DTYPE, UPCAST), q, input_precision=PRECISION)
    dkv_head = off_b * stride_dkb + off_kh * stride_dkh  # dk and dv share one layout
    _store_tile(DK + dkv_head, offs_n, stride_dks, S, dk * sm_scale, HEAD_DIM)
    _store_tile(DV + dkv_head, offs_n, stride_dks, S, dv, HEAD_DIM)


@autotune(*DQ_TILES)
@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, stride_qb, stride_qs, stride_qh, stride_kb,
                   stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos,
                   stride_doh, stride_dqb, stride_dqs, stride_dqh, H, GROUP, S, sm_scale,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """dQ of query rows [start_m, start_m + BLOCK_M) of one head: loop over visible keys."""
    pid_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = pid_bh // H, pid_bh % H
    off_kh = off_h // GROUP
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = offs_m < S
    DTYPE: tl.constexpr = Q.dtype.element_ty
    q = _load_tile(Q + off_b * stride_qb + off_h * stride_qh, offs_m, stride_qs, S, HEAD_DIM,
                   DTYPE, UPCAST)  # fmt: skip
    do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, stride_dos, S, HEAD_DIM,
                    DTYPE, UPCAST)  # fmt: skip
    lse = tl.load(LSE + pid_bh * S + offs_m, mask=rows, other=0.0)
    delta = tl.load(DELTA + pid_bh * S + offs_m, mask=rows, other=0.0)
    k_head = K + off_b * stride_kb + off_kh * stride_kh
    v_head = V + off_b * stride_vb + off_kh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    hi = tl.minimum(start_m + BLOCK_M, S) if CAUSAL else S
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_head, offs_n, stride_ks, S, HEAD_DIM, DTYPE, UPCAST)  # (BLOCK_N, D)
        v = _load_tile(v_head, offs_n, stride_vs, S, HEAD_DIM, DTYPE, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        valid = offs_n[None, :] < S
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, tl.exp2(qk - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(_cast(ds, DTYPE, UPCAST), k, input_precision=PRECISION)
    dq_head = DQ + off_b * stride_dqb + off_h * stride_dqh
    _store_tile(dq_head, offs_m, stride_dqs, S, dq * sm_scale, HEAD_DIM)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any batch/seq/head strides but assume head_dim is contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(t: torch.Tensor) -> str:
    # fp32 inputs get true fp32 products (as torch does by default), not TF32.
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _grid(seq: int, heads: int, block: str):
    """(seq blocks, batch * heads); the block size is the autotuner's pick."""
    return lambda meta: (triton.cdiv(seq, meta[block]), heads)


def _flash_forward(q, k, v, causal: bool, sm_scale: float):
    b, s, h, d = q.shape
    out = torch.empty((b, s, h, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, h, s), device=q.device, dtype=torch.float32)
    _fwd_kernel[_grid(s, b * h, "BLOCK_M")](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        h, h // k.shape[2], s, sm_scale, HEAD_DIM=d, CAUSAL=causal,
        UPCAST=INTERPRETED_AT_IMPORT, PRECISION=_precision(q),
    )  # fmt: skip
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal: bool, sm_scale: float):
    b, s, h, d = q.shape
    h_kv = k.shape[2]
    delta = torch.empty_like(lse)  # (b, h, s)
    _bwd_preprocess[(triton.cdiv(s, 64), b * h)](
        out, dout, delta, *out.stride()[:3], *dout.stride()[:3], h, s, HEAD_DIM=d, BLOCK_M=64
    )
    dq = torch.empty((b, s, h, d), device=q.device, dtype=q.dtype)
    dk = torch.empty((b, s, h_kv, d), device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    common = {"HEAD_DIM": d, "CAUSAL": causal, "UPCAST": INTERPRETED_AT_IMPORT}
    common["PRECISION"] = _precision(q)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    _bwd_dkdv_kernel[_grid(s, b * h_kv, "BLOCK_N")](
        q, k, v, dout, lse, delta, dk, dv, *strides, *dk.stride()[:3],
        h, h_kv, h // h_kv, s, sm_scale, **common,
    )  # fmt: skip
    _bwd_dq_kernel[_grid(s, b * h, "BLOCK_M")](
        q, k, v, dout, lse, delta, dq, *strides, *dq.stride()[:3], h, h // h_kv, s, sm_scale,
        **common,
    )  # fmt: skip
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Triton forward/backward; saves q, k, v, out and the (batch, heads, seq) fp32 LSE."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float):
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        out, lse = _flash_forward(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _flash_backward(
            _unit_stride(dout), q, k, v, out, lse, ctx.causal, ctx.softmax_scale
        )
        return *grads, None, None


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """PyTorch attention with the kernel's signature: SDPA (fast on CPU), plain autograd."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
    group = q.shape[1] // k.shape[1]
    gqa = {}
    if group > 1 and _SDPA_HAS_GQA:
        gqa = {"enable_gqa": True}
    elif group > 1:  # torch < 2.5: materialise the repeated K/V
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, **gqa)
    return out.transpose(1, 2)  # (batch, seq, heads, head_dim)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(
            "expected q (batch, seq, heads, head_dim) and k, v (batch, seq, kv_heads, head_dim); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, s, h, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d) or h % k.shape[2] != 0:
        raise ValueError(
            f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: batch, seq and head_dim must "
            "match and kv_heads must divide heads"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def _unsupported(q: torch.Tensor) -> str | None:
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (supported: {SUPPORTED_HEAD_DIMS})"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype}"
    return None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with GQA; memory O(seq) on the Triton path.

    q: (batch, seq, n_heads, head_dim); k, v: (batch, seq, n_kv_heads, head_dim) with
    n_kv_heads dividing n_heads. ``softmax_scale`` defaults to ``1/sqrt(head_dim)``.
    Returns (batch, seq, n_heads, head_dim) in q's dtype.
    """
    _check_inputs(q, k, v)
    if use_triton(q, k, v, unsupported=_unsupported(q)):
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return opaque(FlashAttentionFunction.apply)(q, k, v, causal, scale)
    return attention_reference(q, k, v, causal, softmax_scale)
