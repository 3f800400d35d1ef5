"""The grouped GEMM (interpreted on CPU) against float64 computed group by group: the output, dx
and dweight in fp32, bf16 and fp16, at features that leave ragged tiles (16 rows x 32 x 32
interpreted), with empty groups first, in the middle and last, one group, one row in all, and
many small groups; the PyTorch path (torch's grouped GEMM, or the masked loop where it does not
take the inputs) the same way and against the kernel; group offsets past 2^31 elements; the
tile-to-group map; dispatch and the input checks."""

import mmap

import pytest
import torch
from megalite.kernels import autotune as tuning
from megalite.kernels import grouped_gemm, grouped_mm
from megalite.kernels.grouped_gemm import (
    DWEIGHT_TILES,
    IEEE_BLOCK_M,
    ROW_TILES,
    GroupedMMFunction,
    _grouped_dweight,
    _tile_map,
    grouped_mm_reference,
    grouped_mm_torch,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
COUNTS = {  # rows per group
    "empty first, middle, last": [0, 21, 0, 40, 0],
    "one group": [45],
    "one row": [0, 1, 0],
    "8 groups, 50 rows": [7, 3, 12, 0, 9, 1, 8, 10],
}
FEATURES = [(37, 70), (100, 130)]  # (in, out): neither a multiple of 32


def _float64_per_group(x, weight, counts, dy):
    """(y, dx, dweight) in float64, one group at a time."""
    x, weight, dy = x.detach().double(), weight.detach().double(), dy.double()
    y, dx, dweight = torch.zeros_like(dy), torch.zeros_like(x), torch.zeros_like(weight)
    start = 0
    for g, n in enumerate(counts):
        rows = slice(start, start + n)
        y[rows] = x[rows] @ weight[g].t()
        dx[rows] = dy[rows] @ weight[g]
        dweight[g] = dy[rows].t() @ x[rows]
        start += n
    return y, dx, dweight


def _run(x, weight, counts, dy):
    """(y, dx, dweight) of grouped_mm; counts on x's device."""
    y = grouped_mm(x, weight, torch.tensor(counts, dtype=torch.int32, device=x.device))
    return (y, *torch.autograd.grad(y, (x, weight), dy))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
@pytest.mark.parametrize("features", FEATURES, ids=str)
def test_matches_float64(dtype, counts, features, randn, rel_err, tolerance):
    in_features, out_features = features
    x = randn(sum(counts), in_features, dtype=dtype)
    weight = randn(len(counts), out_features, in_features, dtype=dtype, scale=0.1)
    dy = randn(sum(counts), out_features, dtype=dtype).detach()
    actual = _run(x, weight, counts, dy)
    expected = _float64_per_group(x, weight, counts, dy)
    for name, got, want in zip(("y", "dx", "dweight"), actual, expected):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert rel_err(got, want) < tolerance[dtype], name
    dweight = actual[2]
    for g, n in enumerate(counts):
        if n == 0:
            assert torch.equal(dweight[g], torch.zeros_like(dweight[g])), g


GROUPED_AT = {  # features (in, out): the dtypes at which torch._grouped_mm takes them
    (64, 96): {torch.float32, torch.bfloat16, torch.float16},
    (36, 44): {torch.float32},  # 16 bytes are 4 fp32 values, 8 16-bit ones
    (37, 70): set(),
}


def _paths_taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The PyTorch path each `grouped_mm_torch` call from now on takes, in order."""
    taken = []
    grouped, masked = grouped_gemm._TorchGroupedMM.apply, grouped_gemm._masked_per_group

    def grouped_recorded(*args):
        taken.append("grouped")
        return grouped(*args)

    def masked_recorded(*args):
        taken.append("masked")
        return masked(*args)

    monkeypatch.setattr(grouped_gemm._TorchGroupedMM, "apply", grouped_recorded)
    monkeypatch.setattr(grouped_gemm, "_masked_per_group", masked_recorded)
    return taken


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
@pytest.mark.parametrize("features", GROUPED_AT, ids=str)
def test_torch_path_matches_float64(
    dtype, counts, features, randn, rel_err, tolerance, monkeypatch
):
    """torch._grouped_mm where its strides allow (features of 16-byte multiples, not float64),
    else the masked loop: each within the kernel's tolerance, float64 exact."""
    in_features, out_features = features
    taken = _paths_taken(monkeypatch)
    x = randn(sum(counts), in_features, dtype=dtype)
    weight = randn(len(counts), out_features, in_features, dtype=dtype, scale=0.1)
    dy = randn(sum(counts), out_features, dtype=dtype).detach()
    y = grouped_mm_torch(x, weight, torch.tensor(counts, device=x.device))
    actual = (y, *torch.autograd.grad(y, (x, weight), dy))
    expected = _float64_per_group(x, weight, counts, dy)
    assert taken == ["grouped" if dtype in GROUPED_AT[features] else "masked"]
    for name, got, want in zip(("y", "dx", "dweight"), actual, expected):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert rel_err(got, want) < tolerance.get(dtype, 1e-12), name


def test_torch_path_takes_any_gradient_layout(randn, rel_err, tolerance, device):
    """torch._grouped_mm's own backward refuses a gradient whose strides are not 16-byte
    multiples, as y.sum()'s (broadcast, stride 0) and a transposed one are; and x and weight as
    transposed views."""
    counts = torch.tensor([9, 0, 23], device=device)
    x = randn(64, 32).t()  # (32, 64), strides (1, 32)
    weight = randn(3, 64, 96).transpose(1, 2)  # (3, 96, 64)
    for dy in (torch.ones(32, 96, device=device).expand(32, 96), randn(96, 32).detach().t()):
        y = grouped_mm_torch(x, weight, counts)
        actual = (y, *torch.autograd.grad(y, (x, weight), dy))
        expected = _float64_per_group(x, weight, [9, 0, 23], dy)
        for name, got, want in zip(("y", "dx", "dweight"), actual, expected):
            assert rel_err(got, want) < tolerance[torch.float32], name


@pytest.mark.parametrize("features", [(37, 70), (64, 96)], ids=["masked", "grouped"])
def test_kernel_torch_path_and_loop_agree(features, randn, rel_err, tolerance, monkeypatch):
    """The Triton kernel, the PyTorch path (either way) and the per-group loop the benchmarks
    time it against (`grouped_mm_reference`)."""
    counts = COUNTS["8 groups, 50 rows"]
    x, weight = randn(50, features[0]), randn(8, features[1], features[0])
    dy = randn(50, features[1]).detach()
    kernel = _run(x, weight, counts, dy)
    y = grouped_mm_reference(x, weight, torch.tensor(counts, device=x.device))
    loop = (y, *torch.autograd.grad(y, (x, weight), dy))
    monkeypatch.setenv("MEGALITE_KERNELS", "torch")
    torch_path = _run(x, weight, counts, dy)
    for name, *got in zip(("y", "dx", "dweight"), kernel, loop, torch_path):
        assert max(rel_err(a, b) for a in got for b in got) < tolerance[torch.float32], name


def test_int64_counts_and_strided_inputs(randn, rel_err, tolerance):
    """int64 counts; x, weight and dy as transposed views (the kernels index by strides)."""
    counts = [9, 0, 24]
    x = randn(37, 33).t()  # (33, 37), strides (1, 33)
    weight = randn(3, 37, 70).transpose(1, 2)  # (3, 70, 37)
    dy = randn(70, 33).detach().t()
    y = grouped_mm(x, weight, torch.tensor(counts, device=x.device))
    actual = (y, *torch.autograd.grad(y, (x, weight), dy))
    expected = _float64_per_group(x, weight, counts, dy)
    for name, got, want in zip(("y", "dx", "dweight"), actual, expected):
        assert rel_err(got, want) < tolerance[torch.float32], name


def test_no_rows(randn):
    x, weight = randn(0, 37), randn(3, 70, 37)
    y = grouped_mm(x, weight, torch.zeros(3, dtype=torch.int32, device=x.device))
    dx, dweight = torch.autograd.grad(y, (x, weight), torch.zeros_like(y))
    assert y.shape == (0, 70) and dx.shape == (0, 37)
    assert torch.equal(dweight, torch.zeros_like(weight))


def test_tile_map():
    """Groups of 0, 5, 0 and 33 rows in 16-row tiles: one tile for group 1, three for group 3,
    and programs past the fourth tile (of the bound cdiv(38, 16) + 4 = 7) get group 4, none.
    int32 counts, as a router's bincount may give them."""
    counts = torch.tensor([0, 5, 0, 33], dtype=torch.int32)
    tile_group, first_tile, offsets = _tile_map(counts, 38, 16)
    assert tile_group.tolist() == [1, 3, 3, 3, 4, 4, 4]
    assert first_tile.tolist() == [0, 0, 1, 1, 4]
    assert offsets.tolist() == [0, 0, 5, 5, 38]
    # wrong counts stay inside x: the sum clamped to the rows, negative counts read as zero
    assert _tile_map(torch.tensor([12, 28]), 30, 16)[2].tolist() == [0, 12, 30]
    assert _tile_map(torch.tensor([-5, 10]), 5, 16)[2].tolist() == [0, 0, 5]


def test_counts_past_the_rows_stay_inside_x(randn, rel_err, tolerance):
    """The kernels clamp the groups to x's rows (on CUDA no host check catches a wrong sum):
    counts summing to 40 over 30 rows cut the last group short. x and dy are the first 30 rows
    of 40-row buffers, so a read past them would change dweight."""
    x = randn(40, 37)[:30]
    weight, dy = randn(2, 70, 37), randn(40, 70).detach()[:30]
    y = GroupedMMFunction.apply(x, weight, torch.tensor([12, 28], device=x.device))
    actual = (y, *torch.autograd.grad(y, (x, weight), dy))
    expected = _float64_per_group(x, weight, [12, 18], dy)
    for name, got, want in zip(("y", "dx", "dweight"), actual, expected):
        assert rel_err(got, want) < tolerance[torch.float32], name


WIDE = 2**32 + 2**16
"""Elements of the buffer that `test_group_offsets_past_2_31_elements` lays weights out in."""


@pytest.fixture
def wide_fp16(device: torch.device) -> torch.Tensor:
    """WIDE fp16 elements (8 GiB). On CPU, anonymous memory mapped without reserving it: only
    the pages written take memory, a few KiB here."""
    if device.type == "cuda":
        return torch.empty(WIDE, dtype=torch.float16, device=device)
    # Linux's MAP_NORESERVE, which the mmap module names from Python 3.13 on
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    return torch.frombuffer(mmap.mmap(-1, 2 * WIDE, flags=flags), dtype=torch.float16)


def test_group_offsets_past_2_31_elements(wide_fp16, randn, rel_err, tolerance):
    """Group g's weight starts g * stride elements in, which passes 2^31 in a weight of 2^31
    elements or more: an int32 product wraps. Three groups 1.5 * 2^30 elements apart, from
    2^30 on, put group 2 at 2^32, where int32 would read and write 0 (inside the buffer: the
    test fails, nothing crashes). Forward and dx read the weight through the row kernel, and
    the dweight kernel writes a gradient laid out the same way."""
    counts, stride, shape = [5, 7, 9], 3 * 2**29, (3, 48, 32)

    def groups_from(offset: int) -> torch.Tensor:
        return wide_fp16.as_strided(shape, (stride, shape[2], 1), storage_offset=offset)

    weight, dweight = groups_from(2**30), groups_from(2**30 + shape[1] * shape[2])
    with torch.no_grad():
        weight.copy_(randn(*shape, dtype=torch.float16, scale=0.1))
        dweight.fill_(float("nan"))
    x = randn(sum(counts), shape[2], dtype=torch.float16)
    dy = randn(sum(counts), shape[1], dtype=torch.float16).detach()
    counts_t = torch.tensor(counts, device=x.device)
    y = grouped_mm(x, weight, counts_t)
    (dx,) = torch.autograd.grad(y, x, dy)
    _grouped_dweight(dy, x, _tile_map(counts_t, x.shape[0], 16)[2], dweight)
    expected = _float64_per_group(x, weight, counts, dy)
    for name, got, want in zip(("y", "dx", "dweight"), (y, dx, dweight), expected):
        assert rel_err(got, want) < tolerance[torch.float16], name


def test_dispatch_takes_the_torch_path_under_torch(randn, monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNELS", "torch")

    def refuse(*args):
        raise AssertionError("the Triton path ran under MEGALITE_KERNELS=torch")

    monkeypatch.setattr(GroupedMMFunction, "apply", refuse)
    x, weight = randn(10, 36), randn(2, 72, 36)
    counts = torch.tensor([4, 6], device=x.device)
    assert torch.equal(grouped_mm(x, weight, counts), grouped_mm_torch(x, weight, counts))


SUM = "counts must be >= 0 and sum to the rows of x, 10"
BAD_INPUTS = {  # case: counts, their dtype, weight shape (x is 10 x 37), the error and its text
    "counts sum to rows - 1": ([4, 5], torch.int64, (2, 70, 37), RuntimeError, SUM),
    "counts sum to rows + 1": ([4, 7], torch.int64, (2, 70, 37), RuntimeError, SUM),
    "a negative count": ([12, -2], torch.int64, (2, 70, 37), RuntimeError, SUM),
    "weight in_features 36": ([4, 6], torch.int64, (2, 70, 36), ValueError, r"\(groups, out, in\)"),
    "3 counts for 2 groups": ([4, 6, 0], torch.int64, (2, 70, 37), ValueError, r"\(groups,\)"),
    "float counts": ([4, 6], torch.float32, (2, 70, 37), ValueError, "int32 or int64"),
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_wrong_inputs_raise_before_either_path_runs(case, backend, device, monkeypatch):
    """Shapes, dtypes and devices, a ValueError; the counts, which no path reads on the host,
    on CPU tensors only, by torch._assert_async (a RuntimeError, at once)."""
    counts, counts_dtype, weight_shape, error, match = BAD_INPUTS[case]
    if error is RuntimeError and device.type == "cuda":
        pytest.skip("on CUDA the counts are not checked: a device-side assert ends the process")
    monkeypatch.setenv("MEGALITE_KERNELS", backend)
    x, weight = torch.zeros(10, 37, device=device), torch.zeros(weight_shape, device=device)
    with pytest.raises(error, match=match):
        grouped_mm(x, weight, torch.tensor(counts, dtype=counts_dtype, device=device))


def test_fp32_tiles_fit_the_fma_budget():
    """fp32 dots are FMAs on CUDA cores: every ieee tile within autotune's per-thread budget."""
    row = [(IEEE_BLOCK_M, n, k, w, s) for n, k, w, s in ROW_TILES[1]]
    dweight = [(m, n, k, w, s) for n, k, m, w, s in DWEIGHT_TILES[1]]
    for block_m, block_n, block_k, warps, stages in row + dweight:
        fmas = tuning.ieee_fmas_per_thread((block_m, block_n, warps, stages), block_k)
        assert fmas <= tuning.IEEE_FMAS_PER_THREAD and stages <= 2


@pytest.mark.parametrize(
    "sweeps, names",
    [(ROW_TILES, ("BLOCK_N", "BLOCK_K")), (DWEIGHT_TILES, ("BLOCK_N", "BLOCK_K", "BLOCK_M"))],
    ids=["rows", "dweight"],
)
def test_compiled_autotune_tries_the_sweep_of_the_precision(sweeps, names, monkeypatch):
    """As compiled (the interpreter has one config): 16-bit calls sweep the tensor-core tiles,
    fp32 (ieee) calls only the small ones."""
    monkeypatch.setattr(grouped_gemm, "INTERPRETED_AT_IMPORT", False)
    jit_fn = grouped_gemm._rows_kernel.fn  # any kernel: only the pruning runs
    tuner = grouped_gemm._autotune(*sweeps, names=names, key=["N"])(jit_fn)
    for precision, tiles in zip(("tf32", "ieee"), sweeps):
        kept = tuner.early_config_prune(tuner.configs, {}, PRECISION=precision)
        assert [(*(c.kwargs[n] for n in names), c.num_warps, c.num_stages) for c in kept] == tiles
