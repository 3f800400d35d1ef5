"""Rotary embedding of q and k in one pass: the Triton kernel (interpreted on CPU) and the PyTorch
reference against float64, forward and both gradients, on contiguous tensors and on the strided
views attention cuts out of its fused q/k/v output."""

import pytest
import torch
from megalite.kernels import rotary_embedding
from megalite.models.layers import rotary_tables

# (batch, seq, heads, kv_heads, head_dim): grouped-query heads, a head_dim whose half (50) is
# not a power of two, a single token, odd head counts
SHAPES = [(2, 40, 4, 2, 32), (1, 1, 3, 1, 16), (3, 7, 5, 5, 100), (1, 9, 6, 3, 64)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "fused_qkv", "heads_first"]
POSITIONS = 48  # more than any seq above: only the first seq rows of the tables are used


def _leaves(randn, layout, b, s, hq, hk, hd, dtype):
    """The tensors q and k are cut from, as `layout` says."""
    if layout == "contiguous":
        return [randn(b, s, hq, hd, dtype=dtype), randn(b, s, hk, hd, dtype=dtype)]
    if layout == "fused_qkv":  # what Attention.forward passes: views of one (b, s, ...) GEMM
        return [randn(b, s, (hq + 2 * hk) * hd, dtype=dtype)]
    return [randn(b, hq, s, hd, dtype=dtype), randn(b, hk, s, hd, dtype=dtype)]


def _views(layout, leaves, b, s, hq, hk, hd):
    """q (b, s, hq, hd) and k (b, s, hk, hd) from the leaves: strided unless contiguous."""
    if layout == "contiguous":
        return leaves
    if layout == "fused_qkv":
        (qkv,) = leaves
        q = qkv[..., : hq * hd].view(b, s, hq, hd)
        return q, qkv[..., hq * hd : (hq + hk) * hd].view(b, s, hk, hd)
    return [t.transpose(1, 2) for t in leaves]  # heads outermost in memory


def _float64(x, cos, sin):
    """x * cos + rotate_half(x) * sin in float64, written out."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    s = x.shape[1]
    return x * cos[:s, None].double() + rotated * sin[:s, None].double()


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rotary_matches_float64(
    shape, layout, dtype, path, randn, rel_err, tolerance, device, monkeypatch
):
    monkeypatch.setenv("MEGALITE_KERNELS", path)
    hd = shape[-1]
    cos, sin = (t.to(device) for t in rotary_tables(hd, POSITIONS, 10000.0))
    leaves = _leaves(randn, layout, *shape, dtype)
    q, k = _views(layout, leaves, *shape)
    q_out, k_out = rotary_embedding(q, k, cos, sin)
    dq, dk = torch.randn_like(q_out), torch.randn_like(k_out)
    grads = torch.autograd.grad([q_out, k_out], leaves, [dq, dk])

    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    q64, k64 = _views(layout, leaves64, *shape)
    expected = _float64(q64, cos, sin), _float64(k64, cos, sin)
    grads64 = torch.autograd.grad(expected, leaves64, [dq.double(), dk.double()])

    errors = [rel_err(q_out, expected[0]), rel_err(k_out, expected[1])]
    errors += [rel_err(g, g64) for g, g64 in zip(grads, grads64, strict=True)]
    assert max(errors) < tolerance[dtype], errors
    assert (q_out.shape, k_out.shape, q_out.dtype) == (q.shape, k.shape, dtype)


def test_rotation_preserves_norms_and_position_zero(randn, device):
    """Each pair is rotated, so per-head norms are kept, and position 0 is not rotated."""
    cos, sin = (t.to(device) for t in rotary_tables(32, POSITIONS, 10000.0))
    q, k = randn(2, 10, 4, 32), randn(2, 10, 2, 32)
    q_out, k_out = rotary_embedding(q, k, cos, sin)
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(k_out[:, 0], k[:, 0])


def test_tables_that_require_grad_get_their_gradients_or_a_clear_error(randn, device, monkeypatch):
    """Learned cos/sin: the kernel differentiates q and k only, so forced Triton refuses them
    (instead of leaving their gradients None) and auto takes the reference."""
    cos, sin = (t.to(device).requires_grad_() for t in rotary_tables(16, 8, 10000.0))
    q, k = randn(1, 5, 2, 16), randn(1, 5, 1, 16)
    with pytest.raises(ValueError, match="require grad"):
        rotary_embedding(q, k, cos, sin)
    with torch.no_grad():  # nothing to differentiate: the kernel runs
        rotary_embedding(q, k, cos, sin)
    monkeypatch.setenv("MEGALITE_KERNELS", "auto")
    q_out, k_out = rotary_embedding(q, k, cos, sin)
    cos_grad, sin_grad = torch.autograd.grad([q_out, k_out], [cos, sin], [q_out, k_out])
    assert cos_grad.abs().sum() > 0 and sin_grad.abs().sum() > 0


def test_sequence_longer_than_the_tables_is_an_error(device):
    cos, sin = (t.to(device) for t in rotary_tables(16, 8, 10000.0))
    q = torch.zeros(1, 9, 2, 16, device=device)
    with pytest.raises(ValueError, match="9 tokens but rotary tables for 8 positions"):
        rotary_embedding(q, q, cos, sin)
