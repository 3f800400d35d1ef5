"""Which tiles the attention kernels autotune over: 16-bit calls sweep the tensor-core tiles,
fp32 calls (ieee dots, FMAs on CUDA cores) only small two-stage tiles within the per-thread FMA
budget at their head size, which is what kept fp32 at head_dim 128 from compiling 128-wide,
3-4-stage tiles for minutes on an H100. Checked on the pruning itself; every candidate is
compiled for a GPU, and its compile timed, by `python tools/build_kernels.py`
(tests/kernels/test_gpu_build.py)."""

import pytest
import torch
from megalite.kernels import autotune as tuning
from megalite.kernels.flash_attention import (
    DKDV_TILES,
    DQ_TILES,
    FWD_TILES,
    SUPPORTED_HEAD_DIMS,
    _bwd_dq_kernel,
    _fwd_kernel,
    _precision,
)

KERNELS = {"fwd": FWD_TILES, "dkdv": DKDV_TILES, "dq": DQ_TILES}


def _tiles(configs) -> list[tuple[int, int, int, int]]:
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]


def test_the_dots_precision_follows_the_dtype():
    assert _precision(torch.zeros(1)) == "ieee"
    assert {_precision(torch.zeros(1, dtype=d)) for d in (torch.bfloat16, torch.float16)} == {
        "tf32"
    }


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_16bit_calls_sweep_the_tensor_core_tiles(kernel, head_dim):
    tensor_core, ieee = KERNELS[kernel]
    assert tuning.tiles_to_try(tensor_core, ieee, "tf32", head_dim) == tensor_core


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_fp32_calls_try_only_small_two_stage_tiles(kernel, head_dim):
    tensor_core, ieee = KERNELS[kernel]
    tiles = tuning.tiles_to_try(tensor_core, ieee, "ieee", head_dim)
    assert tiles and set(tiles) <= set(ieee)
    assert not set(tiles) & set(tensor_core)
    for tile in tiles:
        block_m, block_n, _, stages = tile
        assert max(block_m, block_n) <= 64 and stages <= 2, tile
        assert tuning.ieee_fmas_per_thread(tile, head_dim) <= tuning.IEEE_FMAS_PER_THREAD


def test_fp32_forward_tiles_by_head_size():
    """At head_dim 256 only the 32 x 32 tile with 8 warps fits the budget; at 128 the 32 x 32
    tiles; at 64 the 64 x 64 tile only with 8 warps; at 32 and below the whole ieee list is
    tried."""
    assert tuning.tiles_to_try(*FWD_TILES, "ieee", 256) == [(32, 32, 8, 2)]
    assert tuning.tiles_to_try(*FWD_TILES, "ieee", 128) == [(32, 32, 4, 2), (32, 32, 8, 2)]
    assert tuning.tiles_to_try(*FWD_TILES, "ieee", 64) == [
        (64, 64, 8, 2),
        (64, 32, 4, 2),
        (32, 32, 4, 2),
        (32, 32, 8, 2),
    ]
    for head_dim in (16, 32):
        assert tuning.tiles_to_try(*FWD_TILES, "ieee", head_dim) == FWD_TILES[1]
    # The old sweep's biggest tile: 8,192 FMAs per thread per dot at head_dim 128.
    assert tuning.ieee_fmas_per_thread((128, 64, 4, 3), 128) == 8192


def test_no_tile_fits_is_one_clear_error():
    with pytest.raises(ValueError, match="no ieee tile .* fits head_dim 256: add a smaller one"):
        tuning.tiles_to_try([], [(64, 64, 4, 2)], "ieee", 256)


@pytest.mark.parametrize(
    "precision,head_dim,dtype",
    [("ieee", 128, torch.float32), ("tf32", 128, torch.bfloat16), ("ieee", 64, torch.float32)],
)
def test_triton_prune_hook_keeps_the_calls_configs(precision, head_dim, dtype):
    """The hook Triton calls with the kernel's arguments (tensors by name, constexprs as
    keywords, as `_flash_forward` passes them) returns the configs of `tiles_to_try`, and the
    autotuner builds one config per distinct tile of both sweeps."""
    for tensor_core, ieee in KERNELS.values():
        configs = tuning.configs(tensor_core, ieee)
        assert _tiles(configs) == list(dict.fromkeys(tensor_core + ieee))
        q = torch.zeros(1, 4, 1, head_dim, dtype=dtype)
        kept = tuning.early_prune(tensor_core, ieee)(
            configs, {"Q": q, "S": 4}, HEAD_DIM=head_dim, CAUSAL=True, UPCAST=False,
            PRECISION=precision,
        )  # fmt: skip
        assert _tiles(kept) == tuning.tiles_to_try(tensor_core, ieee, precision, head_dim)


def test_interpreter_builds_one_config_keyed_on_precision(device):
    """Under the interpreter (which cannot autotune) each kernel has its one fixed tile; the
    cache key holds the precision and head size that the pruning depends on."""
    if device.type != "cpu":
        pytest.skip("compiled kernels carry both sweeps")
    for kernel in (_fwd_kernel, _bwd_dq_kernel):
        assert [c.kwargs for c in kernel.configs] == [tuning.INTERPRETED_TILE]
        assert {"HEAD_DIM", "PRECISION"} <= set(kernel.keys)


def test_triton_autotuner_prunes_through_the_hook(device):
    """Triton's own Autotuner, built as `autotune` builds it for a GPU, prunes the forward
    kernel's configs for an fp32 head_dim 128 call to the small tiles (its `prune_configs`, the
    step before it compiles and benchmarks each)."""
    if device.type != "cpu":
        pytest.skip("the interpreted kernel is wrapped here")
    import triton

    prune = {"early_config_prune": tuning.early_prune(*FWD_TILES)}
    tuner = triton.autotune(
        configs=tuning.configs(*FWD_TILES), key=tuning.KEY, prune_configs_by=prune
    )(_fwd_kernel.fn)
    q = torch.zeros(1, 4, 1, 128)
    tuner.nargs = dict(zip(tuner.arg_names, (q, q, q)))
    kwargs = {"HEAD_DIM": 128, "CAUSAL": True, "UPCAST": False}
    assert len(_tiles(tuner.prune_configs({**kwargs, "PRECISION": "tf32"}))) == 5
    kept = _tiles(tuner.prune_configs({**kwargs, "PRECISION": "ieee"}))
    assert kept == [(32, 32, 4, 2), (32, 32, 8, 2)]
