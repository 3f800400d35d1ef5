"""Residual add + LayerNorm / RMSNorm: the Triton kernel (interpreted on CPU) and the PyTorch
reference against float64, forward and every gradient."""

import pytest
import torch
import torch.nn.functional as F
from megalite.kernels import layer_norm, rms_norm
from megalite.kernels.norms import AddNormFunction

# One row per program, the block the next power of two of hidden: odd and ragged hidden sizes,
# a single row, the shipped configs' 256 and 768, and a wide row.
SHAPES = [(3, 37, 100), (1, 37), (2, 5, 256), (4, 768), (3, 5000)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5
# (kind, residual, bias): RMSNorm has no bias
VARIANTS = [
    ("layer", False, True),
    ("layer", True, True),
    ("layer", True, False),
    ("rms", False, False),
    ("rms", True, False),
]


def _float64(kind, x, residual, weight, bias):
    """The norm in float64, written out (not through the code under test)."""
    h = x if residual is None else x + residual
    if kind == "layer":
        return h, F.layer_norm(h, h.shape[-1:], weight, bias, EPS)
    return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _run(kind, x, residual, weight, bias):
    if kind == "layer":
        return layer_norm(x, weight, bias, EPS, residual=residual)
    return rms_norm(x, weight, EPS, residual=residual)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("kind", "has_residual", "has_bias"), VARIANTS, ids=str)
def test_norm_matches_float64(
    kind, has_residual, has_bias, shape, dtype, path, randn, rel_err, tolerance, monkeypatch
):
    monkeypatch.setenv("MEGALITE_KERNELS", path)
    hidden = shape[-1]
    x = randn(*shape, dtype=dtype, scale=2.0)
    residual = randn(*shape, dtype=dtype) if has_residual else None
    weight = (randn(hidden, dtype=torch.float32, scale=0.2) + 1.0).to(dtype).detach()
    weight.requires_grad_()
    bias = randn(hidden, dtype=dtype) if has_bias else None
    inputs = [t for t in (x, residual, weight, bias) if t is not None]
    h, y = _run(kind, x, residual, weight, bias)
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    # with a residual h is the new residual stream: its own gradient joins the norm's
    outputs, upstream = ([h, y], [dh, dy]) if has_residual else ([y], [dy])
    grads = torch.autograd.grad(outputs, inputs, upstream)

    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    x64, residual64 = inputs64[0], inputs64[1] if has_residual else None
    weight64, bias64 = (inputs64[-2], inputs64[-1]) if has_bias else (inputs64[-1], None)
    h64, y64 = _float64(kind, x64, residual64, weight64, bias64)
    outputs64 = [h64, y64] if has_residual else [y64]
    grads64 = torch.autograd.grad(outputs64, inputs64, [u.double() for u in upstream])

    errors = [rel_err(y, y64), rel_err(h, h64)]
    errors += [rel_err(g, g64) for g, g64 in zip(grads, grads64, strict=True)]
    assert max(errors) < tolerance[dtype], errors
    assert {t.dtype for t in (h, y, *grads)} == {dtype}
    assert h.shape == y.shape == x.shape
    if not has_residual:
        assert h is x


def test_triton_backward_saves_the_stream_and_row_statistics(randn):
    """Forward keeps h (not x and the residual) and fp32 statistics per row, nothing wider."""
    x, residual, weight, bias = randn(6, 100), randn(6, 100), randn(100), randn(100)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h, _ = layer_norm(x, weight, bias, EPS, residual=residual)
    wide = {t.data_ptr() for t in saved if t.shape != (6,)}
    assert wide == {h.data_ptr(), weight.data_ptr(), bias.data_ptr()}
    stats = [t.dtype for t in saved if t.shape == (6,)]
    assert stats == [torch.float32] * 2  # mean and 1/std


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_strided_parameters_are_read_through_their_strides(kind, randn, rel_err, tolerance):
    """weight and bias as columns of one stacked tensor (stride 2), forward and gradients."""
    x, residual, stacked = randn(3, 37), randn(3, 37), randn(37, 2)
    weight, bias = stacked[:, 0], stacked[:, 1] if kind == "layer" else None
    inputs = (x, residual, stacked)
    h, y = _run(kind, x, residual, weight, bias)
    dh, dy = torch.randn_like(h), torch.randn_like(y)
    grads = torch.autograd.grad([h, y], inputs, [dh, dy])
    x64, residual64, stacked64 = (t.detach().double().requires_grad_() for t in inputs)
    bias64 = stacked64[:, 1] if kind == "layer" else None
    h64, y64 = _float64(kind, x64, residual64, stacked64[:, 0], bias64)
    grads64 = torch.autograd.grad(
        [h64, y64], (x64, residual64, stacked64), [dh.double(), dy.double()]
    )
    errors = [rel_err(y, y64)] + [rel_err(g, g64) for g, g64 in zip(grads, grads64, strict=True)]
    assert max(errors) < tolerance[torch.float32], errors


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_no_rows(kind, randn):
    """An empty batch: empty outputs and gradients, zero parameter gradients (as the reference)."""
    x, residual, weight, bias = randn(0, 37), randn(0, 37), randn(37), randn(37)
    bias = bias if kind == "layer" else None
    h, y = _run(kind, x, residual, weight, bias)
    inputs = [t for t in (x, residual, weight, bias) if t is not None]
    grads = torch.autograd.grad([h, y], inputs, [torch.ones_like(h), torch.ones_like(y)])
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in inputs]
    assert all(g.abs().sum() == 0 for g in grads)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_fp32_parameters_on_16bit_inputs_give_the_references_dtypes(kind, randn, monkeypatch):
    """LayerNorm keeps x's dtype (as F.layer_norm does), RMSNorm promotes: on either path."""
    x, residual = randn(3, 37, dtype=torch.bfloat16), randn(3, 37, dtype=torch.bfloat16)
    weight, bias = randn(37), randn(37) if kind == "layer" else None
    inputs = [t for t in (x, residual, weight, bias) if t is not None]
    dtypes = {}
    for path in ("triton", "torch"):
        monkeypatch.setenv("MEGALITE_KERNELS", path)
        h, y = _run(kind, x, residual, weight, bias)
        grads = torch.autograd.grad([h, y], inputs, [torch.ones_like(h), torch.ones_like(y)])
        dtypes[path] = [t.dtype for t in (h, y, *grads)]
    assert dtypes["triton"] == dtypes["torch"]


def test_too_wide_rows_fall_back_under_auto_and_fail_loudly_when_forced(device, monkeypatch):
    x = torch.randn(2, 16385, device=device)  # a block of 32768 fp32 lanes: 128 KiB
    weight = torch.ones(16385, device=device)
    with pytest.raises(ValueError, match="hidden size 16385"):
        rms_norm(x, weight, EPS)
    monkeypatch.setenv("MEGALITE_KERNELS", "auto")

    def refuse(*args):
        raise AssertionError("the Triton path ran")

    monkeypatch.setattr(AddNormFunction, "apply", refuse)
    h, y = rms_norm(x, weight, EPS)
    assert h is x and y.shape == x.shape


def test_mismatched_shapes_are_errors(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="parameter"):
        layer_norm(x, torch.ones(4, device=device), None, EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, device=device), EPS, residual=torch.zeros(2, 4, device=device))
