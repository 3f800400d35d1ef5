"""FlashAttention-2 style attention in Triton, with its PyTorch reference.

Why a kernel: plain attention materialises the (seq x seq) score matrix per head, which is the
``5*a*s/h`` term of the activation-memory formula in docs/architecture.md. Here each program
holds one block of query rows, streams key/value blocks through an online softmax, and saves
only the output and the per-row log-sum-exp for backward. Backward recomputes the probabilities
block by block: a preprocess kernel computes ``delta = rowsum(dO * O)``, one kernel produces
dK/dV (one program per key block, looping over the query blocks and over the query heads of its
GQA group, so no atomics and no repeated K/V), and one produces dQ.

Layout is the model's: q (batch, seq, n_heads, head_dim), k/v (batch, seq, n_kv_heads,
head_dim); the kernels index with strides, so no transpose copies. Query head ``h`` uses key
head ``h // (n_heads // n_kv_heads)``, as ``repeat_interleave`` and SDPA's ``enable_gqa`` do.

One block of attention: offsets, documents, LSE
-----------------------------------------------
The same kernels compute attention of a chunk of queries against a chunk of keys, which is
what ring attention (context parallelism) and packed documents (varlen) need:

* Offsets. Query row ``i`` of ``q`` sits at position ``q_offset + i`` of the whole sequence,
  key ``j`` of ``k``/``v`` at ``k_offset + j``; the chunks may differ in length. Causal means
  key ``j`` is visible to row ``i`` iff ``k_offset + j <= q_offset + i``. So a rank holding
  query chunk 3 of a ring runs the diagonal block with equal offsets (causal inside it), an
  earlier key chunk with every key visible, and skips later ones (no key visible).
* Documents. ``doc_start`` (batch, seq_q) holds, per query row, the position where its document
  begins; key ``j`` is visible only if ``k_offset + j >= doc_start[b, i]`` (on top of the
  causal rule). ``doc_start_from_cu_seqlens`` builds it from flash-attn's ``cu_seqlens``, and
  ``flash_attention(..., cu_seqlens=...)`` runs packed windows that way (causal only: a start
  bounds the keys from below, so only the causal rule keeps later documents out).
* Sliding windows. ``window`` (None: none) is Mistral's, Gemma 3's and GPT-OSS's local
  attention, flash-attn's ``window_size=(window - 1, 0)``: row i, at position ``p = q_offset +
  i``, sees the keys at positions ``p - window < position <= p``, itself and the ``window - 1``
  before it (causal only). Like a document start, a window bounds a row's keys from below, at
  ``p - window + 1``; the kernels take the later of the two as the row's first key, so
  positions stay global (a ring's blocks pass the window as they are) and the rules combine.
* LSE. Next to the output, the forward returns per row the natural-log log-sum-exp of its
  visible scaled scores, ``lse = log(sum_j exp(scale * q.k_j))``. A row that sees no key gets
  ``out = 0`` and ``lse = -inf``. (The kernels keep a base-2 LSE inside; the public functions
  convert at the boundary.)
* Merge. Attention over the union of disjoint key blocks is the LSE-weighted mix of the
  per-block results (``attention_block_forward`` gives each block's ``out_j, lse_j``):
  ``lse = logsumexp_j(lse_j)`` and ``out = sum_j exp(lse_j - lse) * out_j``, where a row whose
  ``lse`` is -inf in every block keeps out 0 (subtract 0 instead of -inf to avoid NaN).
  Backward needs no merge: ``attention_block_backward`` rebuilds each block's probabilities
  as ``exp(scale * q.k - lse)`` with the FINAL ``lse`` of the row, and uses
  ``delta = rowsum(dO * O)`` of the final output, so the dQ of the blocks add up (and dK, dV
  over the query chunks) to the gradient of the whole attention.
* Sinks. GPT-OSS gives each query head h a learned logit ``sinks[h]`` that joins every row's
  softmax denominator without a value: ``out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) +
  exp(sinks[h]))``. In the merge's terms the sink is one more block, with out 0 and lse
  ``sinks[h]``: the forward starts each row's online softmax from it (running max the sink,
  denominator 1), so its lse includes the sink and a row that sees no key gets out 0 and lse
  ``sinks[h]``. Given that final lse the keys' backward is unchanged, and the sink's gradient is
  ``-sum over (batch, rows) of exp(sinks[h] - lse_i) * delta_i``. A ring adds the sinks to
  one block of each row, any one, and their gradient once.

Which key blocks a row block visits: causal blocks wholly after its last row are skipped, as
are blocks wholly before the earliest first key (document or window start) of its rows; only
blocks that straddle the diagonal, a first key or the end of the keys pay for a mask, the rest
run unmasked. So a window costs about ``(BLOCK_M + window) / BLOCK_N + 1`` key blocks a row
block, however long the sequence. dK/dV does the same along the query axis: a key block is read
only by the rows within a window after it, and its document bounds are per-key ones (from the
running max and the running min of ``doc_start``) computed on the host, which stay correct
whatever the order of ``doc_start``.

Under the Triton interpreter bf16 values are held as raw integers, so the kernels widen every
load to fp32 there (``UPCAST``); products are still rounded to the input dtype before each
``tl.dot`` so interpreter tests see the same rounding as a GPU.
"""

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import INTERPRETED_AT_IMPORT, tl, triton
from .autotune import autotune
from .dispatch import opaque, use_triton

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E): exp2 is the fast one
# The kernels keep a base-2 LSE; the public one is natural-log: lse = lse2 * LN2.
LN2, INV_LN2 = math.log(2.0), 1.0 / math.log(2.0)


# Tiles each kernel autotunes over, (BLOCK_M, BLOCK_N, num_warps, num_stages): tensor-core
# tiles for 16-bit inputs, and small two-stage ones for fp32's FMA dots, pruned by head size
# (`autotune`). The dK/dV and dQ kernels keep four (BLOCK x HEAD_DIM) fp32 tiles live, so their
# larger ieee tiles take 8 warps. dK/dV's 64 x 32 with 8 warps is there for head_dim 128 with
# grouped K/V (Mixtral, Llama 3): every other tile (but the 32 x 16 below) spills 88 to 1,168
# bytes a thread there, on sm90 and sm80, in every attention variant, and it spills at most 8
# (`tools/build_kernels.py`).
# Head_dim 256 (Gemma 3), sm90, bf16: of the forward's tiles 64 x 32 fits without spilling
# (160 KiB of shared memory; 128 x 64 needs 256), of dQ's 64 x 32 and 128 x 32. dK/dV keeps
# K, V, dK and dV tiles of 256 columns, where every other tile spills 584 to 3,176 bytes a
# thread or does not fit, and 32 x 16 with 8 warps spills none (82 KiB; at 128 neither). In
# fp32, the 32 x 32 (forward, dQ) and 32 x 16 (dK/dV) tiles with 8 warps are the ones within
# the FMA budget at 256, and spill none there.
FWD_TILES = (
    [(128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4)],
    [(64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2)],
)
DKDV_TILES = (
    [(32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 32, 8, 3),
     (32, 16, 8, 3)],
    [(64, 64, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2), (32, 16, 8, 2)],
)  # fmt: skip
DQ_TILES = (
    [(128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3)],
    [(64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2)],
)


@triton.jit
def _program(SEQ, BLOCK: tl.constexpr):
    """(batch x head index, first row) of this program's block. The grid is one axis, since
    CUDA caps a grid's second axis at 65535 programs and its first only at 2^31 - 1, which no
    tensor that fits in memory reaches; the blocks of one (batch, head) are consecutive on it,
    so they run together and share that head's K/V in L2."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(SEQ, BLOCK)
    return (pid // blocks).to(tl.int64), (pid % blocks) * BLOCK


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
    """(len(rows), HEAD_DIM) tile of one head; rows past the sequence read as zeros. Offsets in
    int64: a long sequence's rows times a fused qkv's row stride pass 2**31 (175k tokens at a
    stride of 12,288)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offsets = rows[:, None].to(tl.int64) * stride_s + offs_d[None, :]
    tile = tl.load(head_ptr + offsets, mask=rows[:, None] < S, other=0.0)
    return _cast(tile, DTYPE, UPCAST)


@triton.jit
def _store_tile(head_ptr, rows, stride_s, S, tile, HEAD_DIM: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = head_ptr + rows[:, None].to(tl.int64) * stride_s + offs_d[None, :]  # as `_load_tile`
    tl.store(ptrs, tile.to(head_ptr.dtype.element_ty), mask=rows[:, None] < S)


@triton.jit
def _first_keys(doc_batch, offs_m, S, SHIFT, K_OFF, WINDOW, HAS_DOCS: tl.constexpr,
                HAS_WINDOW: tl.constexpr):  # fmt: skip
    """Per query row, the first key index it may see: the later of its document's start
    (doc_start - K_OFF) and its window's (row + SHIFT - WINDOW + 1); without either a
    placeholder that no mask reads."""
    first = offs_m
    if HAS_WINDOW:
        first = offs_m + (SHIFT - WINDOW + 1)
    if HAS_DOCS:
        doc = tl.load(doc_batch + offs_m, mask=offs_m < S, other=0) - K_OFF
        if HAS_WINDOW:
            first = tl.maximum(first, doc)
        else:
            first = doc
    return first


@triton.jit
def _visible(valid, q_idx, k_idx, first, SHIFT, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr):
    """`valid` narrowed to the (query, key) pairs the rules allow. Indices are the tensors' own;
    query row i sits at key index i + SHIFT (SHIFT = q_offset - k_offset); `first` is each row's
    first visible key index (`_first_keys`), read when BOUNDED (documents or a window).
    Arguments broadcast, so one helper serves S and its transpose."""
    if CAUSAL:
        valid = valid & (k_idx <= q_idx + SHIFT)
    if BOUNDED:
        valid = valid & (k_idx >= first)
    return valid


@triton.jit
def _key_blocks(start_m, rows, first, S, S_K, SHIFT, CAUSAL: tl.constexpr,
                BOUNDED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """(lo, full, mid, hi): the key range one row block visits, in three runs of key blocks.
    [lo, full) straddle the first key (document or window start) of some row (masked), [full,
    mid) are visible to every row (unmasked), [mid, hi) straddle the causal diagonal or the end
    of the keys (masked). Keys before lo or from hi on are visible to no row of the block."""
    if CAUSAL:
        # one past the last key the block's last row sees, and the first row's
        hi = tl.minimum(tl.maximum(tl.minimum(start_m + BLOCK_M, S) + SHIFT, 0), S_K)
        end = tl.minimum(tl.maximum(start_m + SHIFT + 1, 0), hi)
    else:
        hi = S_K
        end = S_K
    lo = 0
    full = 0
    if BOUNDED:  # the min over the rows bounds the skip whatever the order of doc_start
        lo = (tl.maximum(tl.min(tl.where(rows, first, S_K), 0), 0) // BLOCK_N) * BLOCK_N
        last = tl.maximum(tl.max(tl.where(rows, first, 0), 0), 0)
        full = tl.minimum(((last + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, hi)
    mid = full + (tl.maximum(end - full, 0) // BLOCK_N) * BLOCK_N
    return lo, full, mid, hi


@triton.jit
def _query_blocks(QRANGE, off_b, start_n, S, S_K, SHIFT, WINDOW, CAUSAL: tl.constexpr,
                  HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """(lo, mid, end, hi): the query rows whose dK/dV terms one key block gathers, in three runs
    of query blocks. [lo, mid) straddle the causal diagonal (masked), [mid, end) see every key
    of the block (unmasked), [end, hi) straddle a first key (document or window start) or the
    end of the queries (masked). Rows before lo or from hi on see none of its keys. Keys past
    S_K need no mask here: their dK/dV rows are never stored."""
    last_key = tl.minimum(start_n + BLOCK_N, S_K) - 1
    hi = S
    end = S
    if HAS_DOCS:  # per-key row bounds from the host (see `_query_ranges`)
        ranges = QRANGE + off_b * 2 * S_K
        hi = tl.minimum(tl.load(ranges + S_K + last_key), hi)
        end = tl.minimum(tl.load(ranges + start_n), end)
    if HAS_WINDOW:  # row i sees key j only if i < j - SHIFT + WINDOW
        hi = tl.minimum(tl.maximum(last_key - SHIFT + WINDOW, 0), hi)
        end = tl.minimum(tl.maximum(start_n - SHIFT + WINDOW, 0), end)
    end = (end // BLOCK_M) * BLOCK_M
    if CAUSAL:  # row i sees key j iff j <= i + SHIFT
        lo = (tl.maximum(start_n - SHIFT, 0) // BLOCK_M) * BLOCK_M
        mid = ((tl.maximum(last_key - SHIFT, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.maximum(mid, lo), hi)
    else:
        lo = 0
        mid = 0
    end = tl.minimum(tl.maximum(end, mid), hi)
    return lo, mid, end, hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_head, v_head, stride_ks, stride_vs, offs_m, first, lo, hi,
               S_K, SHIFT, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               BOUNDED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Online softmax over key blocks [lo, hi); only MASKED blocks pay for the mask."""
    DTYPE: tl.constexpr = k_head.dtype.element_ty
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_head, cols, stride_ks, S_K, HEAD_DIM, DTYPE, UPCAST)  # (BLOCK_N, D)
        v = _load_tile(v_head, cols, stride_vs, S_K, HEAD_DIM, DTYPE, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            valid = _visible(cols[None, :] < S_K, offs_m[:, None], cols[None, :], first[:, None],
                             SHIFT, CAUSAL, BOUNDED)  # fmt: skip
            qk = tl.where(valid, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # a row that has seen no key keeps m = -inf: subtract 0 there, so p and alpha are 0
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every row sees every key here
            m_sub = m_new
        p = tl.exp2(qk - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(_cast(p, DTYPE, UPCAST), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@autotune(*FWD_TILES)
@triton.jit
def _fwd_kernel(Q, K, V, OUT, LSE, DOC, SINKS, stride_qb, stride_qs, stride_qh, stride_kb,
                stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ob, stride_os,
                stride_oh, H, GROUP, S, S_K, SHIFT, K_OFF, WINDOW, sm_scale,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """Output rows [start_m, start_m + BLOCK_M) of one (batch, head), plus their LSE."""
    pid_bh, start_m = _program(S, BLOCK_M)
    off_b, off_h = pid_bh // H, pid_bh % H
    off_kh = off_h // GROUP  # GQA: the kv head this query head reads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = offs_m < S
    q_head = Q + off_b * stride_qb + off_h * stride_qh
    k_head = K + off_b * stride_kb + off_kh * stride_kh
    v_head = V + off_b * stride_vb + off_kh * stride_vh
    q = _load_tile(q_head, offs_m, stride_qs, S, HEAD_DIM, Q.dtype.element_ty, UPCAST)
    first = _first_keys(DOC + off_b * S, offs_m, S, SHIFT, K_OFF, WINDOW, HAS_DOCS, HAS_WINDOW)
    BOUNDED: tl.constexpr = HAS_DOCS or HAS_WINDOW

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # unnormalised output
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max
    if HAS_SINKS:  # the sink is one more score, exp2(m_i) in the denominator, with no value
        l_i += 1.0
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + off_h) * LOG2E
    qk_scale = sm_scale * LOG2E
    lo, full, mid, hi = _key_blocks(start_m, rows, first, S, S_K, SHIFT, CAUSAL, BOUNDED,
                                    BLOCK_M, BLOCK_N)  # fmt: skip
    if BOUNDED:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_head, v_head, stride_ks, stride_vs,
                                   offs_m, first, lo, full, S_K, SHIFT, qk_scale, True, CAUSAL,
                                   BOUNDED, BLOCK_N, HEAD_DIM, UPCAST, PRECISION)  # fmt: skip
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_head, v_head, stride_ks, stride_vs, offs_m,
                               first, full, mid, S_K, SHIFT, qk_scale, False, CAUSAL, BOUNDED,
                               BLOCK_N, HEAD_DIM, UPCAST, PRECISION)  # fmt: skip
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_head, v_head, stride_ks, stride_vs, offs_m,
                               first, mid, hi, S_K, SHIFT, qk_scale, True, CAUSAL, BOUNDED,
                               BLOCK_N, HEAD_DIM, UPCAST, PRECISION)  # fmt: skip

    o_head = OUT + off_b * stride_ob + off_h * stride_oh
    # a row that saw no key (nor a sink) has acc = 0, l = 0 and m = -inf: out 0 (not 0/0) and
    # lse -inf; with a sink, l = 1 and m = the sink: out 0 and lse the sink
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    _store_tile(o_head, offs_m, stride_os, S, acc / l_i[:, None], HEAD_DIM)
    # base-2 log-sum-exp of the scaled scores: all backward needs to rebuild the probabilities
    tl.store(LSE + pid_bh * S + offs_m, m_i + tl.log2(l_i), mask=rows)


@triton.jit
def _bwd_preprocess(OUT, DO, DELTA, stride_ob, stride_os, stride_oh, stride_dob, stride_dos,
                    stride_doh, H, S, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """delta = rowsum(dO * O): the softmax-backward correction term, one float per row."""
    pid_bh, start_m = _program(S, BLOCK_M)
    off_b, off_h = pid_bh // H, pid_bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    o_head = OUT + off_b * stride_ob + off_h * stride_oh
    do_head = DO + off_b * stride_dob + off_h * stride_doh
    o = _load_tile(o_head, offs_m, stride_os, S, HEAD_DIM, tl.float32, False)
    do = _load_tile(do_head, offs_m, stride_dos, S, HEAD_DIM, tl.float32, False)
    tl.store(DELTA + pid_bh * S + offs_m, tl.sum(o * do, axis=1), mask=offs_m < S)


@triton.jit
def _row_lse(lse_head, offs_m, rows):
    """The rows' base-2 LSE, with -inf (a row that sees no key at all) turned into +inf, so
    that exp2(score - lse) is 0 for it instead of inf."""
    lse = tl.load(lse_head + offs_m, mask=rows, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_head, do_head, lse_head, delta_head, doc_batch, stride_qs,
                stride_dos, offs_n, lo, hi, S, SHIFT, K_OFF, WINDOW, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
                HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dK, dV terms of query blocks [lo, hi) of one query head; only MASKED blocks pay."""
    DTYPE: tl.constexpr = q_head.dtype.element_ty
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m < S
        q = _load_tile(q_head, offs_m, stride_qs, S, HEAD_DIM, DTYPE, UPCAST)  # (BLOCK_M, D)
        do = _load_tile(do_head, offs_m, stride_dos, S, HEAD_DIM, DTYPE, UPCAST)
        lse = _row_lse(lse_head, offs_m, rows)
        delta = tl.load(delta_head + offs_m, mask=rows, other=0.0)
        # scores transposed, (BLOCK_N, BLOCK_M), so dK and dV come out as (BLOCK_N, D)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
        p_t = tl.exp2(qk_t - lse[None, :])
        if MASKED:
            first = _first_keys(doc_batch, offs_m, S, SHIFT, K_OFF, WINDOW, HAS_DOCS,
                                HAS_WINDOW)  # fmt: skip
            valid = _visible(rows[None, :], offs_m[None, :], offs_n[:, None], first[None, :],
                             SHIFT, CAUSAL, HAS_DOCS or HAS_WINDOW)  # fmt: skip
            p_t = tl.where(valid, p_t, 0.0)
        dv += tl.dot(_cast(p_t, DTYPE, UPCAST), do, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])  # softmax backward, transposed
        dk += tl.dot(_cast(ds_t, DTYPE, UPCAST), q, input_precision=PRECISION)
    return dk, dv


@autotune(*DKDV_TILES)
@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DOC, QRANGE, stride_qb, stride_qs,
                     stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh,
                     H, H_KV, GROUP, S, S_K, SHIFT, K_OFF, WINDOW, sm_scale,
                     HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """dK, dV of key rows [start_n, start_n + BLOCK_N) of one kv head, summed over its group."""
    pid_bh, start_n = _program(S_K, BLOCK_N)
    off_b, off_kh = pid_bh // H_KV, pid_bh % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    DTYPE: tl.constexpr = Q.dtype.element_ty
    k = _load_tile(K + off_b * stride_kb + off_kh * stride_kh, offs_n, stride_ks, S_K, HEAD_DIM,
                   DTYPE, UPCAST)  # fmt: skip
    v = _load_tile(V + off_b * stride_vb + off_kh * stride_vh, offs_n, stride_vs, S_K, HEAD_DIM,
                   DTYPE, UPCAST)  # fmt: skip
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    lo, mid, end, hi = _query_blocks(QRANGE, off_b, start_n, S, S_K, SHIFT, WINDOW, CAUSAL,
                                     HAS_DOCS, HAS_WINDOW, BLOCK_M, BLOCK_N)  # fmt: skip
    doc_batch = DOC + off_b * S
    for g in range(GROUP):
        off_h = off_kh * GROUP + g
        q_head = Q + off_b * stride_qb + off_h * stride_qh
        do_head = DO + off_b * stride_dob + off_h * stride_doh
        stats_offset = (off_b * H + off_h) * S
        lse_head, delta_head = LSE + stats_offset, DELTA + stats_offset
        dk, dv = _dkdv_inner(dk, dv, k, v, q_head, do_head, lse_head, delta_head, doc_batch,
                             stride_qs, stride_dos, offs_n, lo, mid, S, SHIFT, K_OFF, WINDOW,
                             qk_scale, True, CAUSAL, HAS_DOCS, HAS_WINDOW, BLOCK_M, HEAD_DIM,
                             UPCAST, PRECISION)  # fmt: skip
        dk, dv = _dkdv_inner(dk, dv, k, v, q_head, do_head, lse_head, delta_head, doc_batch,
                             stride_qs, stride_dos, offs_n, mid, end, S, SHIFT, K_OFF, WINDOW,
                             qk_scale, False, CAUSAL, HAS_DOCS, HAS_WINDOW, BLOCK_M, HEAD_DIM,
                             UPCAST, PRECISION)  # fmt: skip
        dk, dv = _dkdv_inner(dk, dv, k, v, q_head, do_head, lse_head, delta_head, doc_batch,
                             stride_qs, stride_dos, offs_n, end, hi, S, SHIFT, K_OFF, WINDOW,
                             qk_scale, True, CAUSAL, HAS_DOCS, HAS_WINDOW, BLOCK_M, HEAD_DIM,
                             UPCAST, PRECISION)  # fmt: skip
    dkv_head = off_b * stride_dkb + off_kh * stride_dkh  # dk and dv share one layout
    _store_tile(DK + dkv_head, offs_n, stride_dks, S_K, dk * sm_scale, HEAD_DIM)
    _store_tile(DV + dkv_head, offs_n, stride_dks, S_K, dv, HEAD_DIM)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_head, v_head, stride_ks, stride_vs, offs_m, first, lo,
              hi, S_K, SHIFT, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              BOUNDED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dQ terms of key blocks [lo, hi); only MASKED blocks pay for the mask."""
    DTYPE: tl.constexpr = k_head.dtype.element_ty
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_head, offs_n, stride_ks, S_K, HEAD_DIM, DTYPE, UPCAST)  # (BLOCK_N, D)
        v = _load_tile(v_head, offs_n, stride_vs, S_K, HEAD_DIM, DTYPE, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(qk - lse[:, None])
        if MASKED:
            valid = _visible(offs_n[None, :] < S_K, offs_m[:, None], offs_n[None, :],
                             first[:, None], SHIFT, CAUSAL, BOUNDED)  # fmt: skip
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(_cast(ds, DTYPE, UPCAST), k, input_precision=PRECISION)
    return dq


@autotune(*DQ_TILES)
@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DOC, stride_qb, stride_qs, stride_qh, stride_kb,
                   stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos,
                   stride_doh, stride_dqb, stride_dqs, stride_dqh, H, GROUP, S, S_K, SHIFT, K_OFF,
                   WINDOW, sm_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """dQ of query rows [start_m, start_m + BLOCK_M) of one head: loop over visible keys."""
    pid_bh, start_m = _program(S, BLOCK_M)
    off_b, off_h = pid_bh // H, pid_bh % H
    off_kh = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = offs_m < S
    DTYPE: tl.constexpr = Q.dtype.element_ty
    q = _load_tile(Q + off_b * stride_qb + off_h * stride_qh, offs_m, stride_qs, S, HEAD_DIM,
                   DTYPE, UPCAST)  # fmt: skip
    do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, stride_dos, S, HEAD_DIM,
                    DTYPE, UPCAST)  # fmt: skip
    lse = _row_lse(LSE + pid_bh * S, offs_m, rows)
    delta = tl.load(DELTA + pid_bh * S + offs_m, mask=rows, other=0.0)
    first = _first_keys(DOC + off_b * S, offs_m, S, SHIFT, K_OFF, WINDOW, HAS_DOCS, HAS_WINDOW)
    BOUNDED: tl.constexpr = HAS_DOCS or HAS_WINDOW
    k_head = K + off_b * stride_kb + off_kh * stride_kh
    v_head = V + off_b * stride_vb + off_kh * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    lo, full, mid, hi = _key_blocks(start_m, rows, first, S, S_K, SHIFT, CAUSAL, BOUNDED,
                                    BLOCK_M, BLOCK_N)  # fmt: skip
    if BOUNDED:
        dq = _dq_inner(dq, q, do, lse, delta, k_head, v_head, stride_ks, stride_vs, offs_m,
                       first, lo, full, S_K, SHIFT, qk_scale, True, CAUSAL, BOUNDED, BLOCK_N,
                       HEAD_DIM, UPCAST, PRECISION)  # fmt: skip
    dq = _dq_inner(dq, q, do, lse, delta, k_head, v_head, stride_ks, stride_vs, offs_m, first,
                   full, mid, S_K, SHIFT, qk_scale, False, CAUSAL, BOUNDED, BLOCK_N, HEAD_DIM,
                   UPCAST, PRECISION)  # fmt: skip
    dq = _dq_inner(dq, q, do, lse, delta, k_head, v_head, stride_ks, stride_vs, offs_m, first,
                   mid, hi, S_K, SHIFT, qk_scale, True, CAUSAL, BOUNDED, BLOCK_N, HEAD_DIM,
                   UPCAST, PRECISION)  # fmt: skip
    dq_head = DQ + off_b * stride_dqb + off_h * stride_dqh
    _store_tile(dq_head, offs_m, stride_dqs, S, dq * sm_scale, HEAD_DIM)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any batch/seq/head strides but assume head_dim is contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(t: torch.Tensor) -> str:
    # fp32 inputs get true fp32 products (as torch does by default), not TF32.
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _grid(seq: int, heads: int, block: str):
    """(seq blocks x batch * heads,), as `_program` reads it; the block size is the
    autotuner's pick."""
    return lambda meta: (triton.cdiv(seq, meta[block]) * heads,)


def _query_ranges(doc_start: torch.Tensor, seq_k: int, k_offset: int) -> torch.Tensor:
    """(batch, 2, seq_k) int32: per key, bounds on the query rows for the dK/dV kernel's
    document masking (key j is at position k_offset + j).

    [b, 0, j]: the length of the longest prefix of rows whose documents all start at or before
    key j (a searchsorted in the running max of doc_start): those rows see j and every later
    key, so a key block starting at j needs no document mask for them.
    [b, 1, j]: one past the last row that may see key j (a searchsorted in the running min of
    doc_start from the end): every later row starts its document after j.
    Both hold for any doc_start, monotone or not; for the usual non-decreasing one they are
    tight. (The kernel's tiles are only known once the autotuner picks them, so the bounds are
    per key, and the kernel reads them at its block's first and last key.)"""
    starts = doc_start.long()
    keys = (torch.arange(seq_k, device=starts.device) + k_offset).expand(starts.shape[0], -1)
    keys = keys.contiguous()
    running_max = starts.cummax(dim=1).values
    min_after = starts.flip(1).cummin(dim=1).values.flip(1)
    full = torch.searchsorted(running_max, keys, right=True)
    reach = torch.searchsorted(min_after.contiguous(), keys, right=True)
    return torch.stack((full, reach), dim=1).to(torch.int32).contiguous()


def _flash_forward(q, k, v, causal: bool, sm_scale: float, shift: int = 0, k_offset: int = 0,
                   doc_start: torch.Tensor | None = None, window: int | None = None,
                   sinks: torch.Tensor | None = None):  # fmt: skip
    """(out, base-2 lse (b, h, sq) fp32). shift = q_offset - k_offset; doc_start (b, sq) int32
    contiguous or None; sinks (h,) or None."""
    b, s, h, d = q.shape
    s_k = k.shape[1]
    out = torch.empty((b, s, h, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, h, s), device=q.device, dtype=torch.float32)
    docs = doc_start if doc_start is not None else lse  # placeholders the kernel never reads
    sink_logits = sinks.float().contiguous() if sinks is not None else lse
    _fwd_kernel[_grid(s, b * h, "BLOCK_M")](
        q, k, v, out, lse, docs, sink_logits, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *out.stride()[:3], h, h // k.shape[2], s, s_k, shift, k_offset, window or 0, sm_scale,
        HEAD_DIM=d, CAUSAL=causal, HAS_DOCS=doc_start is not None, HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, UPCAST=INTERPRETED_AT_IMPORT, PRECISION=_precision(q),
    )  # fmt: skip
    return out, lse


def _delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """(b, h, s) fp32 rowsum(dout * out), by `_bwd_preprocess`."""
    b, s, h, d = out.shape
    delta = torch.empty((b, h, s), device=out.device, dtype=torch.float32)
    _bwd_preprocess[(triton.cdiv(s, 64) * b * h,)](
        out, dout, delta, *out.stride()[:3], *dout.stride()[:3], h, s, HEAD_DIM=d, BLOCK_M=64
    )
    return delta


def _flash_backward(dout, q, k, v, out, lse, causal: bool, sm_scale: float, shift: int = 0,
                    k_offset: int = 0, doc_start: torch.Tensor | None = None,
                    window: int | None = None, delta: torch.Tensor | None = None,
                    grad_dtype: torch.dtype | None = None):  # fmt: skip
    """(dq, dk, dv) in grad_dtype (default: the inputs'). lse is base 2; delta (b, h, sq) fp32
    contiguous, computed here when None."""
    b, s, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if delta is None:
        delta = _delta(out, dout)
    dq = torch.empty((b, s, h, d), device=q.device, dtype=grad_dtype or q.dtype)
    dk = torch.empty((b, s_k, h_kv, d), device=q.device, dtype=grad_dtype or k.dtype)
    dv = torch.empty_like(dk)
    has_docs = doc_start is not None
    docs = doc_start if has_docs else lse  # placeholders the kernels never read
    ranges = _query_ranges(doc_start, s_k, k_offset) if has_docs else lse
    common = {"HEAD_DIM": d, "CAUSAL": causal, "HAS_DOCS": has_docs}
    common.update(HAS_WINDOW=window is not None, UPCAST=INTERPRETED_AT_IMPORT)
    common.update(PRECISION=_precision(q))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    rules = (shift, k_offset, window or 0, sm_scale)
    _bwd_dkdv_kernel[_grid(s_k, b * h_kv, "BLOCK_N")](
        q, k, v, dout, lse, delta, dk, dv, docs, ranges, *strides, *dk.stride()[:3],
        h, h_kv, h // h_kv, s, s_k, *rules, **common,
    )  # fmt: skip
    _bwd_dq_kernel[_grid(s, b * h, "BLOCK_M")](
        q, k, v, dout, lse, delta, dq, docs, *strides, *dq.stride()[:3], h, h // h_kv, s, s_k,
        *rules, **common,
    )  # fmt: skip
    return dq, dk, dv


def _attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    doc_start: torch.Tensor | None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton forward of whole-sequence attention: (out, base-2 lse, the sinks included)."""
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    return _flash_forward(q, k, v, causal, scale, doc_start=doc_start, window=window, sinks=sinks)


def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                        doc_start: torch.Tensor | None, window: int | None = None,
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Its backward: (dq, dk, dv) in the inputs' dtype, and the fp32 (b, h, s) delta that the
    sinks' gradient needs (`_sink_grad`)."""
    q, k, v, dout = _unit_stride(q), _unit_stride(k), _unit_stride(v), _unit_stride(dout)
    delta = _delta(out, dout)
    grads = _flash_backward(dout, q, k, v, out, lse, causal, scale, doc_start=doc_start,
                            window=window, delta=delta)  # fmt: skip
    return *grads, delta


def _sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks, from the rows' final natural-log lse and delta (b, h, s): a sink is a
    score with no value, so its softmax backward is p * (0 - delta) with p = exp(sink - lse),
    summed over the batch and the rows."""
    p = torch.exp(sinks.float()[None, :, None] - lse)
    return -(p * delta).sum((0, 2)).to(sinks.dtype)


def _save(ctx, q, k, v, out, lse, causal: bool, scale: float, doc_start, window, sinks) -> None:
    """What backward needs: q, k, v, out, the (batch, heads, seq) fp32 LSE, the (batch, seq)
    int32 doc_start when documents mask the attention, and the sinks when there are."""
    optional = (doc_start, sinks)
    ctx.save_for_backward(q, k, v, out, lse, *(t for t in optional if t is not None))
    ctx.causal, ctx.softmax_scale, ctx.window = causal, scale, window
    ctx.given = tuple(t is not None for t in optional)


def _saved_grads(ctx, dout: torch.Tensor, backward) -> tuple[torch.Tensor | None, ...]:
    """Autograd's gradients of (q, k, v, causal, scale, doc_start, window, sinks) by
    `backward`."""
    q, k, v, out, lse, *rest = ctx.saved_tensors
    doc_start, sinks = (rest.pop(0) if given else None for given in ctx.given)
    *grads, delta = backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, doc_start,
                             ctx.window)  # fmt: skip
    dsinks = None if sinks is None else _sink_grad(sinks, lse * LN2, delta)
    return *grads, None, None, None, None, dsinks


class FlashAttentionFunction(torch.autograd.Function):
    """The Triton forward and backward, run eagerly (outside torch.compile: see `_triton`)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float, doc_start=None, window=None,
                sinks=None):  # fmt: skip
        out, lse = _attention_forward(q, k, v, causal, softmax_scale, doc_start, window, sinks)
        _save(ctx, q, k, v, out, lse, causal, softmax_scale, doc_start, window, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        return _saved_grads(ctx, dout, _attention_backward)


# The same forward and backward as operators (torch.library): inside a compiled region each is
# one node of the graph, which inductor calls as it is (no tracing into Triton launches, the
# autotune or their host-side checks) and which does not break the graph.
_forward_op = torch.library.custom_op("megalite::flash_attention", mutates_args=())(
    _attention_forward
)
_backward_op = torch.library.custom_op("megalite::flash_attention_backward", mutates_args=())(
    _attention_backward
)


@_forward_op.register_fake
def _(q, k, v, causal, scale, doc_start, window=None, sinks=None):
    b, s, h, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (b, h, s), dtype=torch.float32
    )


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, scale, doc_start, window=None):
    contiguous = torch.contiguous_format
    grads = tuple(torch.empty_like(t, memory_format=contiguous) for t in (q, k, v))
    return *grads, lse.new_empty(lse.shape)


def _setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale, doc_start, window, sinks = inputs
    _save(ctx, q, k, v, *output, causal, scale, doc_start, window, sinks)


def _op_backward(ctx, dout, _lse_grad):
    return _saved_grads(ctx, dout, _backward_op)


_forward_op.register_autograd(_op_backward, setup_context=_setup)


def _triton(q, k, v, causal: bool, scale: float, doc_start=None, window=None,
            sinks=None) -> torch.Tensor:  # fmt: skip
    """Attention by the Triton kernels: inside a compiled region the operator, one node of the
    graph; eagerly the autograd Function, whose dispatch costs a few times less per call."""
    args = (q, k, v, causal, scale, doc_start, window, sinks)
    if torch.compiler.is_compiling():
        return _forward_op(*args)[0]
    return FlashAttentionFunction.apply(*args)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """PyTorch attention with the kernel's signature: SDPA (fast on CPU), plain autograd. A
    window goes in as SDPA's boolean mask, one (seq_q, seq_k) tensor shared by the heads."""
    window = _check_window(window, causal, q.shape[1] - 1)
    mask = {}
    if window is not None:
        visible = _visible_reference(q.shape[1], k.shape[1], 0, 0, causal, None, q.device, window)
        mask = {"attn_mask": visible[0]}
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
    group = q.shape[1] // k.shape[1]
    gqa = {}
    if group > 1 and _SDPA_HAS_GQA:
        gqa = {"enable_gqa": True}
    elif group > 1:  # torch < 2.5: materialise the repeated K/V
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal and not mask, scale=softmax_scale, **mask, **gqa
    )
    return out.transpose(1, 2)  # (batch, seq, heads, head_dim)


def _visible_reference(seq_q: int, seq_k: int, q_offset: int, k_offset: int, causal: bool,
                       doc_start: torch.Tensor | None, device,
                       window: int | None = None) -> torch.Tensor | None:  # fmt: skip
    """(1 or batch, seq_q, seq_k) bool: which keys each row may see; None when all."""
    keys = torch.arange(seq_k, device=device)[None, :] + k_offset
    rows = torch.arange(seq_q, device=device)[:, None] + q_offset
    rules = []
    if causal:
        rules.append((keys <= rows)[None])
    if window is not None:
        rules.append((keys > rows - window)[None])
    if doc_start is not None:
        rules.append(keys[None] >= doc_start[:, :, None])
    return functools.reduce(torch.logical_and, rules) if rules else None


def _grouped(t: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, s, h, d) -> (b, s, kv_heads, group, d) in dtype: query head i is kv head
    i // group, member i % group."""
    b, s, h, d = t.shape
    return t.to(dtype).reshape(b, s, kv_heads, h // kv_heads, d)


def _block_forward_reference(q, k, v, q_offset: int, k_offset: int, causal: bool,
                             doc_start: torch.Tensor | None, scale: float,
                             window: int | None = None,
                             sinks: torch.Tensor | None = None):  # fmt: skip
    """attention_block_forward in plain torch, fp32 math (fp64 for fp64 inputs). Materialises
    one (batch, heads, seq_q, seq_k) score tensor; differentiable by autograd (in the sinks
    too)."""
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bqngd,bknd->bngqk", _grouped(q, h_kv, dtype), k.to(dtype)) * scale
    visible = _visible_reference(sq, sk, q_offset, k_offset, causal, doc_start, q.device, window)
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, h_kv, group, sq); -inf where no key is visible
    if sinks is not None:  # one more score a row, with no value
        lse = torch.logaddexp(lse, sinks.to(dtype).reshape(h_kv, h // h_kv)[None, :, :, None])
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    out = torch.einsum("bngqk,bknd->bqngd", p, v.to(dtype)).reshape(b, sq, h, d)
    return out.to(q.dtype), lse.reshape(b, h, sq)


def _block_backward_reference(dout, q, k, v, out, lse, q_offset: int, k_offset: int,
                              causal: bool, doc_start: torch.Tensor | None, scale: float,
                              window: int | None, delta: torch.Tensor | None):  # fmt: skip
    """attention_block_backward in plain torch; two (batch, heads, seq_q, seq_k) tensors live."""
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    if delta is None:
        delta = (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(1, 2)  # (b, h, sq)
    q_g, do_g = _grouped(q, h_kv, dtype), _grouped(dout, h_kv, dtype)
    k, v = k.to(dtype), v.to(dtype)
    stats = (b, h_kv, h // h_kv, sq, 1)
    lse = lse.to(dtype).reshape(stats)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows seeing no key: p = 0
    p = torch.einsum("bqngd,bknd->bngqk", q_g, k).mul_(scale).sub_(lse).exp_()
    visible = _visible_reference(sq, sk, q_offset, k_offset, causal, doc_start, q.device, window)
    if visible is not None:
        p.masked_fill_(~visible[:, None, None], 0.0)
    dv = torch.einsum("bngqk,bqngd->bknd", p, do_g)
    ds = torch.einsum("bqngd,bknd->bngqk", do_g, v).sub_(delta.to(dtype).reshape(stats)).mul_(p)
    dq = torch.einsum("bngqk,bknd->bqngd", ds, k).mul_(scale).reshape(b, sq, h, d)
    dk = torch.einsum("bngqk,bqngd->bknd", ds, q_g).mul_(scale)
    return dq, dk, dv


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_seq: bool = True):
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(
            "expected q (batch, seq, heads, head_dim) and k, v (batch, seq, kv_heads, head_dim); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, s, h, d = q.shape
    s_k = s if same_seq else k.shape[1]
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s_k, d) or h % k.shape[2] != 0:
        what = "batch, seq and head_dim" if same_seq else "batch and head_dim"
        raise ValueError(
            f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: {what} must match and kv_heads "
            "must divide heads"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def _check_doc_start(doc_start: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """doc_start as the kernels read it: (batch, seq_q) int32, contiguous, on q's device."""
    if doc_start is None:
        return None
    if doc_start.shape != q.shape[:2] or doc_start.is_floating_point() or doc_start.is_complex():
        raise ValueError(
            f"doc_start must be an integer tensor of shape (batch, seq_q) = {tuple(q.shape[:2])}; "
            f"got {doc_start.dtype} {tuple(doc_start.shape)}"
        )
    return doc_start.to(device=q.device, dtype=torch.int32).contiguous()


def _check_window(window: int | None, causal: bool, reach: int) -> int | None:
    """The window as the kernels take it: a positive int, or None when there is none or when it
    holds every key a row may see (`reach`: the farthest a key of the call lies before a row),
    which is then the causal rule alone, run by the same code as window=None."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"window must be a positive int (the keys a row sees, itself included); got {window!r}"
        )
    if not causal:
        raise ValueError("window needs causal=True: a row sees itself and the window - 1 before it")
    return None if window > reach else window


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    if sinks is not None and (
        tuple(sinks.shape) != (q.shape[2],)
        or not sinks.is_floating_point()
        or sinks.device != q.device
    ):
        raise ValueError(
            f"sinks must be a floating-point tensor of shape (n_heads,) = ({q.shape[2]},) on q's "
            f"device; got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        )
    return sinks


def _unsupported(q: torch.Tensor) -> str | None:
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (supported: {SUPPORTED_HEAD_DIMS})"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype}"
    return None


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _block_forward_triton(q, k, v, q_offset, k_offset, causal, doc_start, scale, window, sinks):
    b, sq, h, _ = q.shape
    if sq == 0 or k.shape[1] == 0:  # nothing to launch: every row sees no key, only its sink
        nothing = torch.full((h,), float("-inf"), device=q.device)
        lse = nothing if sinks is None else sinks.float()
        return torch.zeros_like(q), lse[None, :, None].expand(b, h, sq).contiguous()
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    out, lse = _flash_forward(q, k, v, causal, scale, q_offset - k_offset, k_offset, doc_start,
                              window, sinks)  # fmt: skip
    return out, lse.mul_(LN2)


def _block_backward_triton(dout, q, k, v, out, lse, q_offset, k_offset, causal, doc_start,
                           scale, window, delta):  # fmt: skip
    if q.shape[1] == 0 or k.shape[1] == 0:
        return tuple(torch.zeros(t.shape, device=t.device) for t in (q, k, v))
    q, k, v, out, dout = (_unit_stride(t) for t in (q, k, v, out, dout))
    lse = (lse.float() * INV_LN2).contiguous()  # base 2, as the kernels keep it
    if delta is not None:
        delta = delta.float().contiguous()
    return _flash_backward(dout, q, k, v, out, lse, causal, scale, q_offset - k_offset,
                           k_offset, doc_start, window, delta,
                           grad_dtype=torch.float32)  # fmt: skip


def attention_block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    causal: bool = True,
    doc_start: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query chunk against one key/value chunk: (out, lse).

    q: (batch, seq_q, n_heads, head_dim), k, v: (batch, seq_k, n_kv_heads, head_dim), n_kv_heads
    dividing n_heads; row i sits at position ``q_offset + i``, key j at ``k_offset + j``.
    ``causal``: key j is visible to row i iff ``k_offset + j <= q_offset + i``. ``doc_start``
    (batch, seq_q) integers: row i also sees only keys at positions ``>= doc_start[b, i]``.
    ``window`` (causal only): row i also sees only keys at positions ``> q_offset + i -
    window``. ``sinks`` (n_heads,): each head's sink logit joins this block's softmax (give it
    to one block of each row; its gradient is ``-sum exp(sinks[h] - lse) * delta`` over the
    batch and the rows, with the final lse and delta).
    Returns out (batch, seq_q, n_heads, head_dim) in q's dtype and lse (batch, n_heads, seq_q)
    fp32, the natural-log log-sum-exp of each row's visible scaled scores (and sink); a row
    that sees no key gets out 0 and lse -inf (its sink, with sinks). Not differentiable by
    autograd: pair it with `attention_block_backward` (the module docstring says how blocks
    merge).
    """
    _check_inputs(q, k, v, same_seq=False)
    doc_start = _check_doc_start(doc_start, q)
    scale = _scale(q, softmax_scale)
    window = _check_window(window, causal, q_offset + q.shape[1] - 1 - k_offset)
    sinks = _check_sinks(sinks, q)
    args = (q, k, v, int(q_offset), int(k_offset), causal, doc_start, scale, window, sinks)
    if use_triton(q, k, v, unsupported=_unsupported(q)):
        return opaque(_block_forward_triton)(*args)
    with torch.no_grad():
        out, lse = _block_forward_reference(*args)
    return out, lse.float()


def attention_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    causal: bool = True,
    doc_start: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    window: int | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the attention gradient: (dq, dk, dv) in fp32.

    ``out`` (batch, seq_q, n_heads, head_dim) and ``lse`` (batch, n_heads, seq_q) are the rows'
    FINAL output and natural-log LSE, merged over every key block they attend to (for a single
    block, what `attention_block_forward` returned; sinks included); the probabilities are
    rebuilt as ``exp(scale * q.k - lse)``. ``delta`` (batch, n_heads, seq_q) fp32 is
    ``rowsum(dout * out)``, computed here when not given. Rows with lse -inf get no gradient.
    Summed over the key blocks (dq) and over the query chunks (dk, dv), the results are the
    gradient of the whole attention. Other arguments as for `attention_block_forward`.
    """
    _check_inputs(q, k, v, same_seq=False)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must be q's shape")
    stats = (q.shape[0], q.shape[2], q.shape[1])
    for name, t in (("lse", lse), ("delta", delta)):
        if t is not None and tuple(t.shape) != stats:
            raise ValueError(f"{name} must be (batch, heads, seq_q) = {stats}; got {t.shape}")
    doc_start = _check_doc_start(doc_start, q)
    scale = _scale(q, softmax_scale)
    window = _check_window(window, causal, q_offset + q.shape[1] - 1 - k_offset)
    args = (dout, q, k, v, out, lse, int(q_offset), int(k_offset), causal, doc_start, scale)
    if use_triton(q, k, v, unsupported=_unsupported(q)):
        return opaque(_block_backward_triton)(*args, window, delta)
    with torch.no_grad():
        return _block_backward_reference(*args, window, delta)


def doc_start_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """(batch, seq) int32: where, within its window, each token's document starts.

    ``cu_seqlens`` is flash-attn's varlen convention over the flattened (batch * seq) tokens:
    a 1-D integer tensor of document boundaries, starting at 0, ending at batch * seq, never
    decreasing (a repeated value is an empty document), holding every window start (the
    multiples of seq), since a document cannot span two windows. Raises ValueError otherwise.
    For example batch 1, seq 8, cu_seqlens [0, 3, 8] gives [[0, 0, 0, 3, 3, 3, 3, 3]].
    """
    if cu_seqlens.ndim != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(
            "cu_seqlens must be a 1-D integer tensor of document boundaries; got "
            f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    total = batch * seq
    bounds = cu_seqlens.tolist()  # one host sync, to name what is wrong
    if not bounds or bounds[0] != 0 or bounds[-1] != total:
        ends = f"{bounds[0]} ... {bounds[-1]}" if bounds else "nothing"
        raise ValueError(f"cu_seqlens must start at 0 and end at batch * seq = {total}; got {ends}")
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b < a:
            raise ValueError(
                f"cu_seqlens must be non-decreasing: cu_seqlens[{i}] = {a} > "
                f"cu_seqlens[{i + 1}] = {b}"
            )
    missing = sorted(set(range(0, total, seq)) - set(bounds)) if seq > 0 else []
    if missing:
        raise ValueError(
            f"every window start (a multiple of seq = {seq}) must be a document boundary in "
            f"cu_seqlens, since a document cannot span two windows; missing {missing[:8]}"
        )
    cu = cu_seqlens.to(torch.int64)
    tokens = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu, tokens, right=True) - 1  # each token's document
    return (cu[doc] - tokens // seq * seq).view(batch, seq).to(torch.int32)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with GQA; memory O(seq) on the Triton path.

    q: (batch, seq, n_heads, head_dim); k, v: (batch, seq, n_kv_heads, head_dim) with
    n_kv_heads dividing n_heads. ``softmax_scale`` defaults to ``1/sqrt(head_dim)``.
    ``cu_seqlens``: packed documents, flash-attn's varlen boundaries over the flattened
    (batch * seq) tokens (see `doc_start_from_cu_seqlens`); a token then attends only within
    its document (causal only). ``window``: a sliding window (causal only), flash-attn's
    ``window_size=(window - 1, 0)``: token i attends to tokens ``i - window < j <= i``.
    ``sinks`` (n_heads,): GPT-OSS's learned per-head logits, in each row's softmax denominator
    with no value; differentiable, like q, k and v. Returns (batch, seq, n_heads, head_dim) in
    q's dtype.
    """
    _check_inputs(q, k, v)
    scale = _scale(q, softmax_scale)
    window = _check_window(window, causal, q.shape[1] - 1)
    sinks = _check_sinks(sinks, q)
    doc_start = None
    if cu_seqlens is not None:
        if not causal:  # doc_start bounds the keys from below only: later documents would show
            raise ValueError("cu_seqlens needs causal=True (documents are masked causally)")
        doc_start = doc_start_from_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1]).to(q.device)
    if use_triton(q, k, v, unsupported=_unsupported(q)):
        return _triton(q, k, v, causal, scale, doc_start, window, sinks)
    if doc_start is None and sinks is None:
        return attention_reference(q, k, v, causal, softmax_scale, window)
    # plain autograd through the masked reference (one (seq x seq) score tensor per head)
    return _block_forward_reference(q, k, v, 0, 0, causal, doc_start, scale, window, sinks)[0]
