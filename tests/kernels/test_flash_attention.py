"""Triton flash attention (interpreted on CPU) against float64 textbook attention."""

import math

import pytest
import torch
from megalite.kernels import flash_attention
from megalite.kernels.flash_attention import (
    _backward_op,
    _forward_op,
    attention_reference,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def float64_attention(q, k, v, causal: bool, softmax_scale: float | None = None):
    """Textbook attention in float64 with repeated K/V: the ground truth for the kernels."""
    q, k, v = (t.double() for t in (q, k, v))  # (batch, seq, heads, head_dim)
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (batch, heads, seq_q, seq_k)
    if causal:
        seq = q.shape[1]
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def check_against_float64(q, k, v, causal, rel_err, tol, softmax_scale=None):
    """Output and dq, dk, dv of the kernel vs float64, for one random upstream gradient."""
    out = flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = float64_attention(*leaves, causal, softmax_scale)
    expected_grads = torch.autograd.grad(expected, leaves, dout.double())
    errors = {"out": rel_err(out, expected)}
    errors.update({n: rel_err(g, e) for n, g, e in zip(("dq", "dk", "dv"), grads, expected_grads)})
    assert all(err < tol for err in errors.values()), errors
    for grad, leaf in zip(grads, (q, k, v)):
        assert grad.shape == leaf.shape and grad.dtype == leaf.dtype


# (batch, seq, heads, kv_heads, head_dim, causal, dtype); the interpreter's blocks are 32 wide,
# so seq 1, 37, 77 and 100 leave ragged tails and 64 is an exact multiple.
CASES = [
    (2, 37, 4, 2, 16, True, FP32),
    (2, 37, 4, 2, 16, False, FP32),
    (1, 100, 4, 1, 32, True, FP32),
    (1, 100, 4, 1, 32, False, FP32),
    (2, 64, 2, 2, 64, True, FP32),
    (1, 1, 2, 2, 16, True, FP32),
    (1, 77, 2, 1, 128, True, FP32),
    (2, 37, 4, 2, 32, True, BF16),
    (1, 100, 2, 1, 64, False, BF16),
    (1, 33, 2, 2, 128, True, BF16),
    (1, 50, 4, 2, 64, True, FP16),
    (1, 50, 2, 1, 32, False, FP16),
]


@pytest.mark.parametrize(
    ("batch", "seq", "heads", "kv_heads", "head_dim", "causal", "dtype"), CASES
)
def test_matches_float64(batch, seq, heads, kv_heads, head_dim, causal, dtype, randn, rel_err,
                         tolerance):  # fmt: skip
    q = randn(batch, seq, heads, head_dim, dtype=dtype)
    k = randn(batch, seq, kv_heads, head_dim, dtype=dtype)
    v = randn(batch, seq, kv_heads, head_dim, dtype=dtype)
    check_against_float64(q, k, v, causal, rel_err, tolerance[dtype])


def test_custom_softmax_scale(randn, rel_err, tolerance):
    q, k, v = (randn(1, 45, 2, 32) for _ in range(3))
    check_against_float64(q, k, v, True, rel_err, tolerance[FP32], softmax_scale=0.3)


def test_strided_views_of_fused_qkv(randn, rel_err, tolerance):
    """q, k, v sliced out of one fused projection: non-contiguous, read in place by stride."""
    qkv = randn(2, 40, 3, 2, 16)  # (batch, seq, q/k/v, heads, head_dim)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    check_against_float64(q, k, v, True, rel_err, tolerance[FP32])


def test_forward_saves_no_seq_by_seq_tensor(randn):
    """Only q, k, v, out and a (batch, heads, seq) fp32 log-sum-exp are kept for backward."""
    batch, seq, heads, head_dim = 1, 256, 2, 16
    q, k, v = (randn(batch, seq, heads, head_dim) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        flash_attention(q, k, v, causal=True)
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert saved_bytes == 4 * q.nbytes + batch * heads * seq * 4
    assert saved_bytes < batch * heads * seq * seq * 4  # one fp32 score matrix would not fit


def test_compiled_triton_attention_is_one_node_of_the_graph(randn):
    """Inside torch.compile the Triton path is an operator, not a graph break (fullgraph would
    fail on one), and it computes what the eager Triton path computes, bit for bit."""
    import torch._dynamo as dynamo  # here: importing it imports Triton

    dynamo.reset()
    q, k, v = randn(2, 37, 4, 16), randn(2, 37, 2, 16), randn(2, 37, 2, 16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.device)
    eager = flash_attention(q, k, v)
    compiled = torch.compile(flash_attention, fullgraph=True, dynamic=False)(q, k, v)
    assert torch.equal(compiled, eager)
    grads = torch.autograd.grad(compiled, (q, k, v), dout)
    for got, want in zip(grads, torch.autograd.grad(eager, (q, k, v), dout)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("documents", [False, True])
def test_attention_operators_pass_opcheck(randn, documents):
    """torch.library's own check of the two operators: schema, fake (meta) outputs equal to
    the real ones in shape, dtype and strides, and the registered autograd; on ragged
    sequences, grouped heads, and with documents."""
    seq = 45
    q, k, v = randn(2, seq, 4, 16), randn(2, seq, 2, 16), randn(2, seq, 2, 16)
    doc_start = None
    if documents:
        starts = torch.tensor([0, 0, 0] + [3] * 17 + [20] * 25, dtype=torch.int32)
        doc_start = torch.stack([starts, torch.zeros(seq, dtype=torch.int32)]).to(q.device)
    forward = (q, k, v, True, 0.25, doc_start)
    torch.library.opcheck(_forward_op, forward)
    with torch.no_grad():
        out, lse = _forward_op(*forward)
    backward = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse)
    torch.library.opcheck(_backward_op, (*backward, True, 0.25, doc_start))


def test_reference_gqa_maps_query_head_to_kv_head_by_group(randn, rel_err, monkeypatch):
    """The torch path uses the same head mapping (q head h -> kv head h // group)."""
    monkeypatch.setenv("MEGALITE_KERNELS", "torch")
    q, k, v = randn(2, 9, 6, 8), randn(2, 9, 2, 8), randn(2, 9, 2, 8)
    out = flash_attention(q, k, v, causal=False)
    assert rel_err(out, float64_attention(q, k, v, causal=False)) < 1e-6
    assert rel_err(attention_reference(q, k, v), float64_attention(q, k, v, True)) < 1e-6


@pytest.mark.parametrize(
    ("q_shape", "kv_shape"),
    [((2, 8, 4, 16), (2, 8, 3, 16)), ((2, 8, 4, 16), (2, 9, 2, 16)), ((8, 4, 16), (8, 4, 16))],
)
def test_rejects_mismatched_shapes(q_shape, kv_shape):
    q, k = torch.zeros(q_shape), torch.zeros(kv_shape)
    with pytest.raises(ValueError, match="head"):
        flash_attention(q, k, k.clone())


def test_forced_triton_rejects_unsupported_head_dim(device):
    q = torch.zeros(1, 4, 2, 24, device=device)
    with pytest.raises(ValueError, match="head_dim 24"):
        flash_attention(q, q, q)


def test_batch_times_heads_past_a_grid_axis_limit_launches(device, randn, rel_err, tolerance):
    """CUDA caps a grid's second axis at 65535 programs; the kernels' grid is one axis, so
    65552 (batch, head) pairs launch and match float64. On a GPU only: the interpreter has no
    such cap, and 65552 interpreted programs would take minutes (the CPU tests cover the
    program-to-(batch, head, block) mapping at every shape of CASES)."""
    if device.type == "cpu":
        pytest.skip("the grid limit is CUDA's; checked when the kernel tests run on a GPU")
    q, k, v = (randn(4097, 40, 16, 16) for _ in range(3))  # 65552 (batch, head) pairs
    check_against_float64(q, k, v, True, rel_err, tolerance[FP32])
