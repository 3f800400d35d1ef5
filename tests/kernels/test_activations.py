"""Fused bias-GELU and SwiGLU Triton kernels (interpreted on CPU) against float64."""

import pytest
import torch
import torch.nn.functional as F
from megalite.kernels import bias_gelu, swiglu

# The bias-GELU tile is 32 rows x 128 columns: these leave ragged rows and columns, a single
# row, and an exact multiple of the column tile.
SHAPES = [(3, 37, 100), (1, 129), (2, 5, 256), (70, 40)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_matches_float64(shape, dtype, randn, rel_err, tolerance):
    x, bias = randn(*shape, dtype=dtype, scale=2.0), randn(shape[-1], dtype=dtype)
    out = bias_gelu(x, bias)
    dout = torch.randn_like(out)
    dx, dbias = torch.autograd.grad(out, (x, bias), dout)
    x64, bias64 = (t.detach().double().requires_grad_() for t in (x, bias))
    expected = F.gelu(x64 + bias64, approximate="tanh")
    dx64, dbias64 = torch.autograd.grad(expected, (x64, bias64), dout.double())
    errors = [rel_err(out, expected), rel_err(dx, dx64), rel_err(dbias, dbias64)]
    assert max(errors) < tolerance[dtype], errors
    assert (out.dtype, dx.dtype, dbias.dtype) == (dtype, dtype, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_matches_float64(shape, dtype, randn, rel_err, tolerance):
    gate, up = randn(*shape, dtype=dtype, scale=3.0), randn(*shape, dtype=dtype)
    out = swiglu(gate, up)
    dout = torch.randn_like(out)
    dgate, dup = torch.autograd.grad(out, (gate, up), dout)
    gate64, up64 = (t.detach().double().requires_grad_() for t in (gate, up))
    expected = F.silu(gate64) * up64
    dgate64, dup64 = torch.autograd.grad(expected, (gate64, up64), dout.double())
    errors = [rel_err(out, expected), rel_err(dgate, dgate64), rel_err(dup, dup64)]
    assert max(errors) < tolerance[dtype], errors


def test_extreme_inputs_saturate_without_nan(rel_err, device):
    """Large |x| must saturate the tanh / sigmoid, not overflow into inf or nan."""
    x = torch.tensor([[-200.0, -30.0, -1e-4, 0.0, 1e-4, 30.0, 200.0]], device=device)
    x.requires_grad_()
    bias = torch.zeros(7, device=device, requires_grad=True)
    for out, expected in [
        (bias_gelu(x, bias), F.gelu(x.double(), approximate="tanh")),
        (swiglu(x, torch.ones_like(x)), F.silu(x.double())),
    ]:
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(out).all() and torch.isfinite(grad).all()
        assert rel_err(out, expected) < 1e-6


def saved_for_backward(fn, *inputs) -> list[torch.Tensor]:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    return saved


@pytest.mark.parametrize("fn", [bias_gelu, swiglu])
def test_backward_saves_only_inputs(fn, randn):
    inputs = (randn(4, 64), randn(64) if fn is bias_gelu else randn(4, 64))
    saved = saved_for_backward(fn, *inputs)
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in inputs)


def test_bias_gelu_rejects_wrong_bias_shape(device):
    with pytest.raises(ValueError, match="bias"):
        bias_gelu(torch.zeros(2, 8, device=device), torch.zeros(4, device=device))
