"""Sliding windows, attention sinks and head_dim 256 in flash attention: the Triton kernels
(interpreted on CPU) and the PyTorch reference path against float64 attention written out here
(scores, the visible mask, a softmax over them and the sink column, the product with v), on
ragged shapes (the interpreter's blocks are 32 wide), forward and backward."""

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import leaves, lse_err, rel, use
from megalite.kernels import attention_block_backward, attention_block_forward, flash_attention
from megalite.kernels.flash_attention import (
    _backward_op,
    _forward_op,
    attention_reference,
    doc_start_from_cu_seqlens,
)

BACKENDS = ["triton", "torch"]
TOL = 1e-4  # fp32 inputs against float64
inf = float("inf")


def float64_attention(q, k, v, *, q_offset=0, k_offset=0, causal=True, window=None,
                      doc_start=None, sinks=None):  # fmt: skip
    """(out, natural-log lse) in float64, differentiable in q, k, v and sinks. Key j is visible
    to row i iff ``k_offset + j <= q_offset + i`` (causal), ``> q_offset + i - window`` and
    ``>= doc_start[b, i]``; each head's sink is one more score column whose value is 0. A row
    that sees nothing gets out 0 and lse -inf (its sink, with sinks)."""
    q, k, v = (t.double() for t in (q, k, v))  # (batch, seq, heads, head_dim)
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    rows = torch.arange(sq, device=q.device)[:, None] + q_offset
    keys = torch.arange(k.shape[1], device=q.device)[None, :] + k_offset
    visible = (keys <= rows) | (not causal)
    if window is not None:
        visible = visible & (keys > rows - window)
    visible = visible[None, None]
    if doc_start is not None:
        visible = visible & (keys[None, None] >= doc_start.to(q.device)[:, None, :, None])
    scores = scores.masked_fill(~visible, -inf)
    if sinks is not None:
        sink_column = sinks.double()[None, :, None, None].expand(b, h, sq, 1)
        scores = torch.cat([scores, sink_column], dim=-1)
        v = torch.cat([v, v.new_zeros(b, 1, h, d)], dim=1)
    row_max = scores.amax(-1, keepdim=True)
    row_max = row_max.masked_fill(row_max == -inf, 0.0).detach()
    weights = (scores - row_max).exp()
    total = weights.sum(-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", weights / total.clamp_min(1e-300), v)
    return out, (total.log() + row_max).squeeze(-1)


def check_attention(q, k, v, *, tol=TOL, sinks=None, cu_seqlens=None, **rules):
    """flash_attention's output and gradients (q, k, v and the sinks) against float64."""
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    out = flash_attention(q, k, v, cu_seqlens=cu_seqlens, sinks=sinks, **rules)
    assert out.shape == q.shape and out.dtype == q.dtype
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    grads = torch.autograd.grad(out, inputs, dout)
    leaf = leaves(*inputs)
    doc_start = None
    if cu_seqlens is not None:
        doc_start = doc_start_from_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    sink = leaf[3] if sinks is not None else None
    ref_out, _ = float64_attention(*leaf[:3], sinks=sink, doc_start=doc_start, **rules)
    ref_grads = torch.autograd.grad(ref_out, leaf, dout.double())
    errors = {"out": rel(out, ref_out)}
    for name, g, e, t in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, inputs):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        errors[name] = rel(g, e)
    assert all(err < tol for err in errors.values()), errors
    return out, grads


# (batch, seq, heads, kv_heads, head_dim, window)
WINDOWS = {
    "inside_a_block": (2, 77, 4, 2, 16, 5),
    "only_itself": (1, 37, 2, 2, 16, 1),
    "one_block": (1, 96, 2, 2, 16, 32),
    "across_blocks": (1, 130, 4, 1, 32, 40),
    "all_but_one_key": (1, 70, 2, 1, 16, 69),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", WINDOWS)
def test_window_matches_float64(case, backend, randn, monkeypatch):
    use(backend, monkeypatch)
    b, s, h, h_kv, d, window = WINDOWS[case]
    q, k, v = randn(b, s, h, d), randn(b, s, h_kv, d), randn(b, s, h_kv, d)
    check_attention(q, k, v, window=window)


@pytest.mark.parametrize("window", [2, 31, 33, 34, 63, 65])
def test_window_edges_near_block_edges(window, randn):
    """Windows whose edges fall one row or key either side of a block's (32 under the
    interpreter): where a kernel's block ranges start and end, and which blocks go unmasked."""
    q, k, v = randn(1, 100, 2, 16), randn(1, 100, 1, 16), randn(1, 100, 1, 16)
    check_attention(q, k, v, window=window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_past_the_sequence_is_full_causal(backend, randn, monkeypatch):
    """A window holding every earlier key is the causal rule: the same bits as window=None."""
    use(backend, monkeypatch)
    q, k, v = randn(1, 45, 4, 16), randn(1, 45, 2, 16), randn(1, 45, 2, 16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q)
    causal = flash_attention(q, k, v)
    causal_grads = torch.autograd.grad(causal, (q, k, v), dout)
    for window in (45, 1000):
        out = flash_attention(q, k, v, window=window)
        assert torch.equal(out, causal)
        for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), causal_grads):
            assert torch.equal(got, want)
    assert not torch.equal(flash_attention(q, k, v, window=44), causal)


# batch 2 windows of 63 tokens: documents of 5, 30, 1, 27 tokens, then 31 and 32
CU_SEQLENS = [0, 5, 35, 36, 63, 94, 126]


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_within_documents(backend, randn, monkeypatch):
    """The window and the document start both bound a row's keys; the later one rules."""
    use(backend, monkeypatch)
    q, k, v = randn(2, 63, 4, 16), randn(2, 63, 2, 16), randn(2, 63, 2, 16)
    cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    check_attention(q, k, v, window=9, cu_seqlens=cu_seqlens)


def check_block(q, k, v, dout, *, sinks=None, tol=TOL, **rules):
    """One block on its own (its out/lse are the final ones) against float64."""
    out, lse = attention_block_forward(q, k, v, sinks=sinks, **rules)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    grads = attention_block_backward(dout, q, k, v, out, lse, **rules)
    leaf = leaves(q, k, v)
    ref_out, ref_lse = float64_attention(*leaf, sinks=sinks, **rules)
    ref_grads = torch.autograd.grad(ref_out, leaf, dout.double())
    errors = {"out": rel(out, ref_out), "lse": lse_err(lse, ref_lse)}
    for name, g, e in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        errors[name] = rel(g, e)
    assert all(err < tol for err in errors.values()), errors
    return out, lse, grads


# (seq_q, seq_k, heads, kv_heads, head_dim, q_offset, k_offset, window): ring pieces, rows at
# q_offset + i against keys at k_offset + j
WINDOW_BLOCKS = {
    "chunk_2_vs_chunk_0": (32, 32, 4, 2, 16, 64, 0, 16),  # the window excludes every key
    "partly_visible": (37, 45, 2, 1, 16, 40, 0, 20),  # rows from 24 on see no key
    "diagonal": (70, 70, 4, 2, 32, 64, 64, 10),
    "some_rows_dead": (40, 20, 2, 2, 16, 30, 0, 15),  # rows 4.. see nothing
    "one_ahead": (70, 70, 2, 1, 16, 1, 0, 33),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", WINDOW_BLOCKS)
def test_window_block_matches_float64(case, backend, randn, monkeypatch):
    use(backend, monkeypatch)
    sq, sk, h, h_kv, d, q_offset, k_offset, window = WINDOW_BLOCKS[case]
    q, k, v = randn(2, sq, h, d), randn(2, sk, h_kv, d), randn(2, sk, h_kv, d)
    dout = randn(2, sq, h, d).detach()
    out, lse, grads = check_block(q, k, v, dout, q_offset=q_offset, k_offset=k_offset,
                                  window=window)  # fmt: skip
    if case == "chunk_2_vs_chunk_0":
        assert (out == 0).all() and (lse == -inf).all()
        assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_with_unordered_doc_start_and_offsets(backend, randn, monkeypatch):
    use(backend, monkeypatch)
    gen = torch.Generator().manual_seed(7)
    q_offset, k_offset, sq, sk = 50, 20, 70, 65
    positions = torch.arange(sq) + q_offset
    doc_start = (torch.rand(2, sq, generator=gen) * (positions + 1)).long()
    q, k, v = randn(2, sq, 4, 16), randn(2, sk, 2, 16), randn(2, sk, 2, 16)
    dout = randn(2, sq, 4, 16).detach()
    check_block(q, k, v, dout, q_offset=q_offset, k_offset=k_offset, window=24,
                doc_start=doc_start.to(q.device))  # fmt: skip


def merge(outs, lses):
    """Combine per-block (out, lse) by their log-sum-exp (rows dead everywhere stay 0)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # (b, h, sq)
    safe = lse.masked_fill(lse == -inf, 0.0)
    out = sum(
        (lse_j - safe).exp().transpose(1, 2)[..., None] * out_j for out_j, lse_j in zip(outs, lses)
    )
    return out, lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_of_windowed_blocks_with_sinks(backend, randn, monkeypatch):
    """Rows at 40..109 against keys 0..99 in three chunks, as a ring computes them: the window
    passed to every block, the sinks to one; merged, they are the single call, and the summed
    block gradients (from the final out/lse, delta once) and the sinks' gradient from the
    final lse are float64's."""
    use(backend, monkeypatch)
    q_offset, bounds, window = 40, [0, 37, 70, 100], 30
    q, k, v = randn(2, 70, 4, 16), randn(2, 100, 2, 16), randn(2, 100, 2, 16)
    sinks = randn(4)
    dout = randn(2, 70, 4, 16).detach()
    chunks = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
    parts = [
        attention_block_forward(
            q,
            k.narrow(1, a, n),
            v.narrow(1, a, n),
            q_offset=q_offset,
            k_offset=a,
            window=window,
            sinks=sinks.detach() if a == 0 else None,
        )  # fmt: skip
        for a, n in chunks
    ]
    assert (parts[0][1] > -inf).all() and (parts[0][0][:, 26:] == 0).all()  # only sinks
    out, lse = merge(*zip(*parts))
    delta = (dout * out).sum(-1).transpose(1, 2)
    dq, dk, dv = torch.zeros(q.shape, device=q.device), [], []
    for a, n in chunks:
        grads = attention_block_backward(
            dout, q, k.narrow(1, a, n), v.narrow(1, a, n), out, lse, q_offset=q_offset,
            k_offset=a, window=window, delta=delta,
        )  # fmt: skip
        dq += grads[0]
        dk.append(grads[1])
        dv.append(grads[2])
    dsinks = -(torch.exp(sinks.detach()[None, :, None] - lse) * delta).sum((0, 2))
    leaf = leaves(q, k, v, sinks)
    ref_out, ref_lse = float64_attention(*leaf[:3], q_offset=q_offset, window=window,
                                         sinks=leaf[3])  # fmt: skip
    expected = torch.autograd.grad(ref_out, leaf, dout.double())
    assert rel(out, ref_out) < TOL and lse_err(lse, ref_lse) < TOL
    for got, want in zip((dq, torch.cat(dk, 1), torch.cat(dv, 1), dsinks), expected):
        assert rel(got, want) < TOL


# (batch, seq, heads, kv_heads, head_dim, window)
SINKS = {
    "sinks": (2, 77, 4, 2, 16, None),
    "sinks_and_window": (1, 130, 4, 1, 32, 40),
    "sinks_and_small_window": (2, 37, 2, 2, 16, 3),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SINKS)
def test_sinks_match_float64(case, backend, randn, monkeypatch):
    use(backend, monkeypatch)
    b, s, h, h_kv, d, window = SINKS[case]
    q, k, v = randn(b, s, h, d), randn(b, s, h_kv, d), randn(b, s, h_kv, d)
    sinks = randn(h, scale=2.0)  # some dominate their rows, some hardly count
    check_attention(q, k, v, sinks=sinks, window=window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_sinks_and_window(backend, randn, monkeypatch):
    """bf16 inputs and bf16 sinks (the parameter's dtype): grads come back in bf16."""
    use(backend, monkeypatch)
    bf16 = torch.bfloat16
    q, k, v = (randn(1, 45, 2, 32, dtype=bf16) for _ in range(3))
    check_attention(q, k, v, sinks=randn(2, dtype=bf16), window=12, tol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key_keep_their_sink(backend, randn, monkeypatch):
    """With sinks, a row that sees no key of a block gets out 0 and lse = its head's sink."""
    use(backend, monkeypatch)
    q, k, v = randn(1, 40, 4, 16), randn(1, 30, 2, 16), randn(1, 30, 2, 16)
    sinks = randn(4).detach()
    for keys in (k, k[:, :0]):  # keys after every row; no keys at all
        values = v[:, : keys.shape[1]]
        out, lse = attention_block_forward(q, keys, values, k_offset=50, sinks=sinks)
        assert (out == 0).all()
        torch.testing.assert_close(lse, sinks[None, :, None].expand(1, 4, 40))


# (batch, seq, heads, kv_heads, window, sinks, dtype): Gemma 3's head size
HEAD_DIM_256 = {
    "causal": (1, 40, 2, 1, None, False, torch.float32),
    "window_and_sinks": (1, 45, 2, 2, 20, True, torch.float32),
    "bf16_window": (1, 40, 2, 1, 9, False, torch.bfloat16),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", HEAD_DIM_256)
def test_head_dim_256(case, backend, randn, monkeypatch):
    use(backend, monkeypatch)
    b, s, h, h_kv, window, with_sinks, dtype = HEAD_DIM_256[case]
    q = randn(b, s, h, 256, dtype=dtype)
    k, v = randn(b, s, h_kv, 256, dtype=dtype), randn(b, s, h_kv, 256, dtype=dtype)
    sinks = randn(h) if with_sinks else None
    tol = TOL if dtype == torch.float32 else 2e-2
    check_attention(q, k, v, sinks=sinks, window=window, tol=tol)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the NaN the kernels read
def test_blocks_outside_every_window_are_skipped(randn):
    """NaN in data that no row of a block may see never reaches it: the kernels skip such key
    blocks (a masked block would still multiply the NaN by 0). Rows from 256 on, in windows of
    8, read no key below 32 in the forward or dQ, and key block 0's dK/dV reads no row from 256
    on, at every tile of the sweeps (up to 128 rows or keys)."""
    sq, window, nan_keys, late_rows = 288, 8, 32, 256
    q, k, v = randn(1, sq, 1, 16), randn(1, sq, 1, 16), randn(1, sq, 1, 16)
    q, k, v = q.detach(), k.detach(), v.detach()
    dout = randn(1, sq, 1, 16).detach()
    poisoned_k, poisoned_v, poisoned_dout = k.clone(), v.clone(), dout.clone()
    poisoned_k[:, :nan_keys] = float("nan")
    poisoned_v[:, :nan_keys] = float("nan")
    poisoned_dout[:, late_rows:] = float("nan")
    out, lse = attention_block_forward(q, k, v, window=window)
    dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, window=window)

    out_p, lse_p = attention_block_forward(q, poisoned_k, poisoned_v, window=window)
    assert torch.equal(out_p[:, late_rows:], out[:, late_rows:])
    assert torch.equal(lse_p[..., late_rows:], lse[..., late_rows:])
    dq_p, _, _ = attention_block_backward(dout, q, poisoned_k, poisoned_v, out, lse,
                                          window=window)  # fmt: skip
    assert torch.equal(dq_p[:, late_rows:], dq[:, late_rows:])
    _, dk_p, dv_p = attention_block_backward(poisoned_dout, q, k, v, out, lse, window=window)
    assert torch.equal(dk_p[:, :nan_keys], dk[:, :nan_keys])
    assert torch.equal(dv_p[:, :nan_keys], dv[:, :nan_keys])
    # what the test would see of blocks that are read: without the window, NaN everywhere
    assert out_p[:, :nan_keys].isnan().all()
    assert attention_block_forward(q, poisoned_k, poisoned_v)[0][:, late_rows:].isnan().all()
    assert dk_p[:, nan_keys:].isnan().any()


def test_window_and_sinks_operators_pass_opcheck(randn):
    """torch.library's check of the operators with a window and sinks (their gradient included),
    on ragged sequences and grouped heads."""
    q, k, v = randn(2, 45, 4, 16), randn(2, 45, 2, 16), randn(2, 45, 2, 16)
    forward = (q, k, v, True, 0.25, None, 10, randn(4))
    torch.library.opcheck(_forward_op, forward)
    with torch.no_grad():
        out, lse = _forward_op(*forward)
    backward = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse)
    torch.library.opcheck(_backward_op, (*backward, True, 0.25, None, 10))


def test_compiled_window_and_sinks_are_one_node_of_the_graph(randn):
    """Inside torch.compile the window (a constant of the graph) and the sinks (an input, with
    its gradient) go through the operator, with no graph break: the same bits as eagerly, but
    for the sinks' gradient, whose sum inductor fuses in its own order."""
    import torch._dynamo as dynamo  # here: importing it imports Triton

    dynamo.reset()
    q, k, v = randn(1, 37, 4, 16), randn(1, 37, 2, 16), randn(1, 37, 2, 16)
    sinks = randn(4)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.device)

    def attention(q, k, v, sinks):
        return flash_attention(q, k, v, window=9, sinks=sinks)

    eager = attention(q, k, v, sinks)
    compiled = torch.compile(attention, fullgraph=True, dynamic=False)(q, k, v, sinks)
    assert torch.equal(compiled, eager)
    inputs = (q, k, v, sinks)
    *grads, dsinks = torch.autograd.grad(compiled, inputs, dout)
    *eager_grads, eager_dsinks = torch.autograd.grad(eager, inputs, dout)
    for got, want in zip(grads, eager_grads):
        assert torch.equal(got, want)
    assert rel(dsinks, eager_dsinks) < 1e-6


def test_torch_path_masks_sdpa_only_for_a_window(randn, monkeypatch):
    """Without a window the torch path is SDPA's causal kernel, no mask built; with one, SDPA
    gets one boolean (seq, seq) mask for every head."""
    use("torch", monkeypatch)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    q, k, v = randn(2, 20, 4, 8), randn(2, 20, 2, 8), randn(2, 20, 2, 8)
    flash_attention(q, k, v)
    windowed = flash_attention(q, k, v, window=6)
    assert calls[0]["is_causal"] and "attn_mask" not in calls[0]
    mask = calls[1]["attn_mask"]
    assert not calls[1]["is_causal"] and mask.dtype == torch.bool and mask.shape == (20, 20)
    expected = float64_attention(q, k, v, window=6)[0]
    assert rel(windowed, expected) < 1e-6
    assert rel(attention_reference(q, k, v, window=6), expected) < 1e-6


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"window": 0}, "window must be a positive int"),
        ({"window": 2.5}, "window must be a positive int"),
        ({"window": 4, "causal": False}, "window needs causal=True"),
        ({"sinks": torch.zeros(3)}, "sinks must be .* shape \\(n_heads,\\) = \\(2,\\)"),
        ({"sinks": torch.zeros(2, dtype=torch.int64)}, "sinks must be a floating-point"),
    ],
)
def test_bad_windows_and_sinks_are_named(kwargs, problem, device):
    q = torch.zeros(1, 8, 2, 16, device=device)
    if "sinks" in kwargs:
        kwargs = {**kwargs, "sinks": kwargs["sinks"].to(device)}
    with pytest.raises(ValueError, match=problem):
        flash_attention(q, q, q, **kwargs)
    with pytest.raises(ValueError, match=problem):
        attention_block_forward(q, q, q, **kwargs)
