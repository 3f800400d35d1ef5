"""Attention of a query chunk against one key chunk (ring attention) and packed documents
(varlen), on the Triton kernels (interpreted on CPU) and on the PyTorch reference path, against
float64 attention written out here."""

import math

import pytest
import torch
from kernel_checks import leaves, lse_err, rel, use
from megalite.kernels import attention_block_backward, attention_block_forward, flash_attention
from megalite.kernels.flash_attention import doc_start_from_cu_seqlens

BACKENDS = ["triton", "torch"]
TOL = 1e-4  # fp32 inputs against float64
inf = float("inf")


def float64_block(q, k, v, q_offset=0, k_offset=0, causal=True, doc_start=None, scale=None):
    """(out, natural-log lse) in float64, differentiable; a row that sees no key gets out 0 and
    lse -inf without a NaN in its gradient."""
    q, k, v = (t.double() for t in (q, k, v))  # (batch, seq, heads, head_dim)
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    rows = torch.arange(q.shape[1], device=q.device)[:, None] + q_offset
    keys = torch.arange(k.shape[1], device=q.device)[None, :] + k_offset
    visible = (keys <= rows if causal else torch.ones_like(keys <= rows))[None, None]
    if doc_start is not None:
        visible = visible & (keys[None, None] >= doc_start.to(q.device)[:, None, :, None])
    row_max = scores.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True)
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0).detach()
    weights = torch.where(visible, scores - row_max, float("-inf")).exp()
    total = weights.sum(-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", weights / total.clamp_min(1e-300), v)
    return out, (total.log() + row_max).squeeze(-1)


def check_block(q, k, v, dout, *, q_offset, k_offset, causal, doc_start=None, tol=TOL):
    """One block on its own (its out/lse are the final ones) against float64."""
    kwargs = dict(q_offset=q_offset, k_offset=k_offset, causal=causal, doc_start=doc_start)
    out, lse = attention_block_forward(q, k, v, **kwargs)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    grads = attention_block_backward(dout, q, k, v, out, lse, **kwargs)
    leaf = leaves(q, k, v)
    ref_out, ref_lse = float64_block(*leaf, **kwargs)
    ref_grads = torch.autograd.grad(ref_out, leaf, dout.double())
    errors = {"out": rel(out, ref_out), "lse": lse_err(lse, ref_lse)}
    for name, g, e, t in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert g.dtype == torch.float32 and g.shape == t.shape
        assert torch.isfinite(g).all(), name
        errors[name] = rel(g, e)
    assert all(err < tol for err in errors.values()), errors
    assert torch.isfinite(out).all()
    dead = (ref_lse == float("-inf")).transpose(1, 2)  # (batch, seq_q, heads)
    assert (out[dead] == 0).all()
    return out, lse, grads


# (seq_q, seq_k, heads, kv_heads, head_dim, q_offset, k_offset, causal); interpreter blocks
# are 32 wide, so 37 and 70 leave ragged tails.
BLOCKS = {
    "keys_before": (37, 45, 4, 2, 16, 100, 20, True),  # every key visible
    "diagonal": (70, 70, 4, 2, 32, 64, 64, True),
    "overlap": (37, 70, 2, 2, 16, 50, 20, True),  # row i sees keys 0 .. 30 + i
    "one_ahead": (70, 70, 2, 1, 16, 1, 0, True),  # row i sees keys 0 .. i + 1
    "overlap_some_rows_dead": (40, 37, 4, 1, 16, 10, 30, True),  # rows 0..19 see nothing
    "keys_after": (37, 40, 4, 2, 16, 0, 37, True),  # no row sees any key
    "non_causal": (37, 70, 4, 2, 16, 500, 0, False),
    "aligned": (64, 32, 2, 1, 32, 32, 0, True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BLOCKS)
def test_block_matches_float64(case, backend, randn, monkeypatch):
    use(backend, monkeypatch)
    sq, sk, h, h_kv, d, q_offset, k_offset, causal = BLOCKS[case]
    q, k, v = randn(2, sq, h, d), randn(2, sk, h_kv, d), randn(2, sk, h_kv, d)
    dout = randn(2, sq, h, d).detach()
    out, lse, grads = check_block(q, k, v, dout, q_offset=q_offset, k_offset=k_offset,
                                  causal=causal)  # fmt: skip
    if case == "keys_after":
        assert (out == 0).all() and (lse == float("-inf")).all()
        assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_lse_minus_inf_get_no_gradient(backend, randn, monkeypatch):
    """The final lse, not this block's, decides: a row given lse -inf (and out 0) contributes
    nothing, even in a block where it sees every key."""
    use(backend, monkeypatch)
    q, k, v = randn(1, 64, 2, 16), randn(1, 64, 2, 16), randn(1, 64, 2, 16)
    dout = randn(1, 64, 2, 16).detach()
    dead = torch.zeros(64, dtype=torch.bool, device=q.device)
    dead[40:50] = True  # rows of the second, unmasked-at-the-start query block
    out, lse = attention_block_forward(q, k, v, q_offset=64)  # all keys visible
    out, lse = out.masked_fill(dead[None, :, None, None], 0.0), lse.masked_fill(dead, -inf)
    dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, q_offset=64)
    leaf = leaves(q, k, v)
    live_dout = dout.masked_fill(dead[None, :, None, None], 0.0).double()
    expected = torch.autograd.grad(float64_block(*leaf, q_offset=64)[0], leaf, live_dout)
    assert (dq[:, dead] == 0).all()
    for got, want in zip((dq, dk, dv), expected):
        assert rel(got, want) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_block_and_varlen(backend, randn, monkeypatch):
    """bf16 inputs: the block's out is bf16 and its grads fp32 (to accumulate over blocks);
    varlen hands the user grads in the input dtype."""
    use(backend, monkeypatch)
    bf16 = torch.bfloat16
    q, k, v = (randn(1, 45, 2, 32, dtype=bf16) for _ in range(3))
    dout = randn(1, 45, 2, 32, dtype=bf16).detach()
    check_block(q, k, v, dout, q_offset=40, k_offset=30, causal=True, tol=2e-2)
    out = flash_attention(q, k, v, cu_seqlens=torch.tensor([0, 17, 45], dtype=torch.int32))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.dtype == bf16 and all(g.dtype == bf16 for g in grads)


def merge(outs, lses):
    """Combine per-block (out, lse) by their log-sum-exp (rows dead everywhere stay 0)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # (b, h, sq)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    out = sum(
        (lse_j - safe).exp().transpose(1, 2)[..., None] * out_j for out_j, lse_j in zip(outs, lses)
    )
    return out, lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_merge_into_one_call(backend, randn, monkeypatch):
    """Keys split in three chunks, each a block call: LSE-merged outputs equal the single call,
    and the summed block gradients (rebuilt from the final out/lse) equal its gradient."""
    use(backend, monkeypatch)
    q_offset, bounds = 40, [0, 37, 70, 100]  # rows at 40..109 against keys 0..99
    q, k, v = randn(2, 70, 4, 16), randn(2, 100, 2, 16), randn(2, 100, 2, 16)
    dout = randn(2, 70, 4, 16).detach()
    out, lse = attention_block_forward(q, k, v, q_offset=q_offset)
    chunks = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
    parts = [
        attention_block_forward(
            q, k.narrow(1, a, n), v.narrow(1, a, n), q_offset=q_offset, k_offset=a
        )  # fmt: skip
        for a, n in chunks
    ]
    merged_out, merged_lse = merge(*zip(*parts))
    assert rel(merged_out, out) < TOL and lse_err(merged_lse, lse) < TOL

    delta = (dout * merged_out).sum(-1).transpose(1, 2)  # the ring computes it once
    dq, dk, dv = torch.zeros(q.shape, device=q.device), [], []
    for a, n in chunks:
        grads = attention_block_backward(
            dout, q, k.narrow(1, a, n), v.narrow(1, a, n), merged_out, merged_lse,
            q_offset=q_offset, k_offset=a, delta=delta,
        )  # fmt: skip
        dq += grads[0]
        dk.append(grads[1])
        dv.append(grads[2])
    leaf = leaves(q, k, v)
    ref_out, ref_lse = float64_block(*leaf, q_offset=q_offset)
    expected = torch.autograd.grad(ref_out, leaf, dout.double())
    single = attention_block_backward(dout, q, k, v, out, lse, q_offset=q_offset)
    for got, whole, exp in zip((dq, torch.cat(dk, 1), torch.cat(dv, 1)), single, expected):
        assert rel(got, exp) < TOL and rel(whole, exp) < TOL
    assert rel(merged_out, ref_out) < TOL and lse_err(merged_lse, ref_lse) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_unordered_doc_start_with_offsets(backend, randn, monkeypatch):
    """doc_start need not be monotone for correctness: random starts, ring offsets, and rows
    whose document starts after every key of the block."""
    use(backend, monkeypatch)
    gen = torch.Generator().manual_seed(7)
    q_offset, k_offset, sq, sk = 50, 20, 70, 65
    positions = torch.arange(sq) + q_offset
    doc_start = (torch.rand(2, sq, generator=gen) * (positions + 1)).long()
    doc_start[:, 66] = 90  # after the last key (84): a dead row
    q, k, v = randn(2, sq, 4, 16), randn(2, sk, 2, 16), randn(2, sk, 2, 16)
    dout = randn(2, sq, 4, 16).detach()
    for causal in (True, False):
        check_block(q, k, v, dout, q_offset=q_offset, k_offset=k_offset, causal=causal,
                    doc_start=doc_start)  # fmt: skip


# batch 2 windows of 63 tokens: documents of 5, 30, 1, 27 tokens, then 31 and 32
CU_SEQLENS = [0, 5, 35, 36, 63, 94, 126]


def test_doc_start_from_cu_seqlens():
    starts = doc_start_from_cu_seqlens(torch.tensor(CU_SEQLENS, dtype=torch.int32), 2, 63)
    expected = [0] * 5 + [5] * 30 + [35] + [36] * 27, [0] * 31 + [31] * 32
    assert starts.dtype == torch.int32 and starts.tolist() == [list(row) for row in expected]
    # a repeated boundary is an empty document
    repeated = doc_start_from_cu_seqlens(torch.tensor([0, 3, 3, 8, 8]), 1, 8)
    assert repeated.tolist() == [[0, 0, 0, 3, 3, 3, 3, 3]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_matches_float64_and_separate_documents(backend, randn, monkeypatch):
    use(backend, monkeypatch)
    cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    q, k, v = randn(2, 63, 4, 16), randn(2, 63, 2, 16), randn(2, 63, 2, 16)
    out = flash_attention(q, k, v, cu_seqlens=cu_seqlens)
    assert out.shape == q.shape and out.dtype == q.dtype
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    leaf = leaves(q, k, v)
    doc_start = doc_start_from_cu_seqlens(cu_seqlens, 2, 63)
    ref_out, _ = float64_block(*leaf, doc_start=doc_start)
    ref_grads = torch.autograd.grad(ref_out, leaf, dout.double())
    errors = {"out": rel(out, ref_out)}
    errors.update({n: rel(g, e) for n, g, e in zip(("dq", "dk", "dv"), grads, ref_grads)})
    assert all(err < TOL for err in errors.values()), errors

    # each document on its own, through the plain causal path
    flat = [t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v)]
    pieces = []
    for a, b in zip(CU_SEQLENS, CU_SEQLENS[1:]):
        pieces.append(flash_attention(*(t[None, a:b] for t in flat))[0])
    separate = torch.cat(pieces).view_as(out)
    separate_grads = torch.autograd.grad(separate, flat, dout)
    assert rel(out, separate) < TOL
    for got, want in zip(grads, separate_grads):
        assert rel(got, want.view_as(got)) < TOL


@pytest.mark.parametrize(
    ("bounds", "problem"),
    [
        ([0, 30, 70, 126], "window start .* missing \\[63\\]"),
        ([0, 40, 30, 63, 126], "non-decreasing: cu_seqlens\\[1\\] = 40 > cu_seqlens\\[2\\] = 30"),
        ([0, 63, 120], "end at batch \\* seq = 126"),
        ([5, 63, 126], "start at 0"),
    ],
)
def test_bad_cu_seqlens_are_named(bounds, problem, device):
    q = torch.zeros(2, 63, 2, 16, device=device)
    with pytest.raises(ValueError, match=problem):
        flash_attention(q, q, q, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))


def test_cu_seqlens_must_be_integers_and_causal(device):
    q = torch.zeros(1, 8, 2, 16, device=device)
    with pytest.raises(ValueError, match="integer"):
        flash_attention(q, q, q, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="causal"):
        flash_attention(q, q, q, causal=False, cu_seqlens=torch.tensor([0, 8]))
