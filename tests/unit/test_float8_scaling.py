"""Float8 scales and casts (megalite/float8/scaling.py, gemm.py) against a float64 reference:
the amax, the scale (torchao's max / amax, rounded down to a power of two), saturation at the
e4m3 and e5m2 limits, the formats' grids, zero tensors, rowwise scales, `torch._scaled_mm` on
shapes that are not multiples of 16, and the error a GPU without float8 GEMMs gets."""

import math

import pytest
import torch

from megalite.config import load_config
from megalite.errors import ConfigError
from megalite.float8.gemm import Float8Training, float8_training, scaled_mm
from megalite.float8.scaling import (
    E4M3,
    E5M2,
    RECIPES,
    amax_to_scale,
    cast,
    dequantise,
    quantise_rows,
    quantise_tensor,
)

TENSORWISE, ROWWISE = RECIPES["tensorwise"], RECIPES["rowwise"]
LIMITS = {E4M3: 448.0, E5M2: 57344.0}


def _nearest_float8(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 reference: each value saturated to the format's range and rounded to its
    nearest representable value (ties to the even significand), from the format's own list."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    grid = codes[torch.isfinite(codes)].unique()
    clamped = values.clamp(-LIMITS[dtype], LIMITS[dtype])
    distance = (clamped.unsqueeze(-1) - grid).abs()
    nearest = distance.min(dim=-1, keepdim=True).values
    candidates = distance <= nearest * (1 + 1e-12)
    # ties: the candidate whose code is even (the even significand)
    code_of = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    even = torch.tensor([(code_of == g).nonzero()[0, 0].item() % 2 == 0 for g in grid])
    pick = torch.where(candidates.sum(-1, keepdim=True) > 1, candidates & even, candidates)
    return grid[pick.float().argmax(-1)]


def test_the_formats_limits_are_torchs():
    assert torch.finfo(E4M3).max == LIMITS[E4M3]
    assert torch.finfo(E5M2).max == LIMITS[E5M2]


@pytest.mark.parametrize("power_of_2", [False, True])
def test_scale_is_max_over_amax_in_float64(power_of_2):
    t = torch.randn(37, 19, dtype=torch.float64) * 3
    amax = t.abs().max()
    scale = amax_to_scale(amax.float(), E4M3, power_of_2)
    expected = 448.0 / amax.float().double().item()
    if power_of_2:
        expected = 2.0 ** math.floor(math.log2(expected))
    assert scale.dtype == torch.float32
    assert scale.item() == pytest.approx(expected, rel=1e-7)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_rounds_to_nearest_and_saturates(dtype):
    g = torch.Generator().manual_seed(0)
    limit = LIMITS[dtype]
    values = torch.cat(
        [
            torch.randn(500, generator=g, dtype=torch.float64) * limit / 4,
            torch.tensor([limit * 1.5, -limit * 7, limit, -limit, 1e-9, 0.0], dtype=torch.float64),
        ]
    )
    got = cast(values.float(), torch.tensor(1.0), dtype).double()
    assert torch.equal(got, _nearest_float8(values.float().double(), dtype))
    assert got.abs().max().item() == limit  # saturated, never inf or nan


@pytest.mark.parametrize("recipe", [TENSORWISE, ROWWISE], ids=["tensorwise", "rowwise"])
def test_the_amax_lands_on_the_formats_range(recipe):
    """The tensor's (row's) amax casts to the top binade of the format: at most its max, and
    with a power-of-two scale above half of it."""
    t = torch.randn(40, 24, dtype=torch.float64) * 5
    quantise = quantise_rows if recipe.rowwise else quantise_tensor
    q = quantise(t.float(), E4M3, recipe)
    top = q.data.double().abs().amax(dim=-1 if recipe.rowwise else None)
    assert (top <= 448).all() and (top >= 224).all()
    assert torch.equal(
        q.data.double(), _nearest_float8(t.float().double() * q.scale.double(), E4M3)
    )


def test_rowwise_scales_follow_each_row():
    t = torch.randn(6, 32, dtype=torch.float64)
    t[2] *= 1e4
    t[4] *= 1e-4
    q = quantise_rows(t.float(), E4M3, ROWWISE)
    assert q.scale.shape == (6, 1)
    amax = t.float().abs().amax(dim=1, keepdim=True).double()
    expected = 2.0 ** torch.floor(torch.log2(448.0 / amax))
    assert torch.equal(q.scale.double(), expected)
    # each row's error is relative to that row: the tiny row keeps its precision
    error = (dequantise(q, torch.float64) - t).abs().amax(dim=1) / t.abs().amax(dim=1)
    assert (error < 2**-4).all()


@pytest.mark.parametrize("rowwise", [False, True])
def test_zero_tensors_get_a_finite_scale_and_cast_to_zeros(rowwise):
    t = torch.zeros(4, 16)
    q = quantise_rows(t, E4M3, ROWWISE) if rowwise else quantise_tensor(t, E5M2, TENSORWISE)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert torch.equal(q.data.float(), t)
    assert torch.equal(dequantise(q, torch.float32), t)


@pytest.mark.parametrize("shape", [(5, 7, 3), (17, 33, 9), (1, 1, 1), (64, 48, 80)])
@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_equals_the_float64_product_of_the_cast_values(shape, rowwise):
    """`torch._scaled_mm` on CPU, shapes that are not multiples of 16 included: the product of
    the dequantised operands, accumulated in fp32."""
    m, k, n = shape
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    recipe = ROWWISE if rowwise else TENSORWISE
    quantise = quantise_rows if rowwise else quantise_tensor
    qa, qb = quantise(a, E4M3, recipe), quantise(b, E4M3, recipe)
    got = scaled_mm(qa, qb, torch.float32)
    reference = dequantise(qa, torch.float64) @ dequantise(qb, torch.float64).t()
    assert got.shape == (m, n)
    assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max())
    out = torch.empty(m, n)
    assert torch.equal(scaled_mm(qa, qb, torch.float32, out=out), got)


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_tensorwise_scales_run_as_equal_row_scales_with_the_same_result(dtypes):
    """On the CPU a tensorwise product takes `_scaled_mm`'s per-row path (its singleton path
    is a scalar loop); the result is the singleton path's, bit for bit."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(19, 40, generator=g), torch.randn(23, 40, generator=g) * 1e-3
    qa, qb = quantise_tensor(a, dtypes[0], TENSORWISE), quantise_tensor(b, dtypes[1], TENSORWISE)
    singleton = torch._scaled_mm(
        qa.data,
        qb.data.t(),
        scale_a=qa.scale.reciprocal(),
        scale_b=qb.scale.reciprocal(),
        out_dtype=torch.float32,
    )
    assert torch.equal(scaled_mm(qa, qb, torch.float32), singleton)


def test_e5m2_and_e4m3_operands_multiply_together():
    dy, w = torch.randn(8, 24), torch.randn(40, 24)
    grad, weight = quantise_tensor(dy, E5M2, TENSORWISE), quantise_tensor(w, E4M3, TENSORWISE)
    product = scaled_mm(grad, weight, torch.float32)
    reference = dequantise(grad, torch.float64) @ dequantise(weight, torch.float64).t()
    assert torch.allclose(product.double(), reference, rtol=1e-5, atol=1e-5)


def test_min_dim_keeps_small_linears_in_the_compute_dtype():
    float8 = Float8Training(TENSORWISE, min_dim=1024)
    assert float8.applies(1024, 4096) and not float8.applies(4096, 768)
    assert Float8Training(TENSORWISE, min_dim=0).applies(1, 1)


def test_none_builds_nothing_and_the_cpu_may_run_float8():
    assert float8_training("none", 0, torch.device("cpu")) is None
    assert float8_training("rowwise", 16, torch.device("cpu")).recipe is ROWWISE


def test_a_gpu_below_sm89_is_refused_naming_it_and_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as error:
        float8_training("tensorwise", 0, torch.device("cuda", 0))
    message = str(error.value)
    assert "NVIDIA A100-SXM4-80GB is sm80" in message and "set train.fp8=none" in message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8_training("tensorwise", 0, torch.device("cuda", 0)) is not None


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.fp8=e4m3", "train.fp8 must be none, tensorwise or rowwise, got 'e4m3'"),
        ("train.fp8_min_dim=-1", "train.fp8_min_dim must be >= 0"),
    ],
)
def test_bad_fp8_settings_are_one_error_naming_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_fp8_refuses_fp16_and_defaults_off():
    with pytest.raises(ConfigError, match="set train.precision=bf16, or train.fp8=none"):
        load_config(None, ["train.fp8=tensorwise", "train.precision=fp16"])
    train = load_config(None, []).train
    assert (train.fp8, train.fp8_min_dim) == ("none", 1024)
