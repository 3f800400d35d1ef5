"""The weight-gradient accumulation kernel (interpreted on CPU) against float64: 16-bit dy and x,
an fp32 main grad overwritten or added to, at shapes that leave ragged tiles on every dim. Under
``auto`` the same checks cover what runs by default: cuBLAS's fp32-output GEMM on a GPU, the
reference on CPU."""

import pytest
import torch
from megalite.kernels import wgrad_accumulate
from megalite.kernels.wgrad import wgrad_accumulate_reference

# (tokens, out, in): ragged against every tile (64 x 64 x 32 interpreted, 64 to 256 rows and
# columns, 32 or 64 tokens compiled), one token, exact multiples, several tiles of the largest
SHAPES = [(37, 70, 100), (1, 3, 5), (64, 64, 128), (100, 130, 33), (300, 520, 260)]
TOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("overwrite", [True, False], ids=["first", "accumulate"])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_wgrad_matches_float64(shape, dtype, overwrite, backend, randn, rel_err, monkeypatch):
    """fp32 accumulation of exact 16-bit products: as close to float64 as fp32 sums get."""
    monkeypatch.setenv("MEGALITE_KERNELS", backend)
    tokens, out, inp = shape
    dy, x = randn(tokens, out, dtype=dtype).detach(), randn(tokens, inp, dtype=dtype).detach()
    main_grad = randn(out, inp).detach()
    expected = dy.double().t() @ x.double() + (0 if overwrite else main_grad.double())
    wgrad_accumulate(main_grad, dy, x, overwrite=overwrite)
    assert main_grad.dtype == torch.float32
    assert rel_err(main_grad, expected) < TOL[dtype]


def test_wgrad_strided_inputs(randn, rel_err):
    """Transposed (non-contiguous) inputs and a main grad that is a view of a larger buffer."""
    dy = randn(40, 20, dtype=torch.float16).detach().t().contiguous().t()
    x = randn(9, 40, dtype=torch.float16).detach().t()  # (40, 9), strides (1, 40)
    flat = torch.zeros(20 * 9 + 7, device=dy.device)
    main_grad = flat[7:].view(20, 9)
    wgrad_accumulate(main_grad, dy, x)
    assert rel_err(main_grad, dy.double().t() @ x.double()) < 1e-5
    assert flat[:7].abs().sum() == 0


def test_reference_is_what_unfused_autograd_computes(randn, monkeypatch):
    """fp32 on the reference: the same numbers as today's `.grad` copied, then added."""
    monkeypatch.setenv("MEGALITE_KERNELS", "torch")
    dy, x = randn(30, 12).detach(), randn(30, 7).detach()
    main_grad = torch.empty(12, 7, device=dy.device)
    wgrad_accumulate(main_grad, dy, x, overwrite=True)
    assert torch.equal(main_grad, dy.t() @ x)
    wgrad_accumulate_reference(main_grad, dy, x, overwrite=False)
    assert torch.allclose(main_grad, 2 * (dy.t() @ x), rtol=1e-6, atol=0)


def test_triton_rejects_fp32_inputs(device):
    with pytest.raises(ValueError, match="does not support"):
        wgrad_accumulate(
            torch.zeros(2, 3, device=device),
            torch.zeros(4, 2, device=device),
            torch.zeros(4, 3, device=device),
        )


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    ("main_grad", "dy", "x"),
    [((3, 4), (5, 6), (5, 4)), ((6, 3), (5, 6), (5, 4)), ((6, 4), (5, 6), (2, 5, 4))],
    ids=["out", "in", "3d"],
)
def test_wrong_shapes_are_one_error_and_write_nothing(main_grad, dy, x, backend, monkeypatch):
    """A main grad that does not fit dy^T x (a view into a flat buffer, say) is refused before
    anything is written past it."""
    monkeypatch.setenv("MEGALITE_KERNELS", backend)
    flat = torch.zeros(100)
    target = flat[: main_grad[0] * main_grad[1]].view(main_grad)
    with pytest.raises(ValueError, match="expected fp32"):
        wgrad_accumulate(target, torch.ones(dy).bfloat16(), torch.ones(x).bfloat16())
    assert flat.abs().sum() == 0
