"""Which tile shapes a kernel autotunes over, by the precision of its dots and the head size.

The attention kernels' sweeps are tensor-core tiles (128 rows, 3-4 pipeline stages), right for
16-bit inputs. fp32 inputs get true fp32 products (``input_precision="ieee"``, as torch's
matmuls by default), which no tensor core computes: Triton emits each ``tl.dot`` as unrolled
FMAs on the CUDA cores, BLOCK_M * BLOCK_N * HEAD_DIM / (32 * num_warps) of them per thread.
At head_dim 128 a 128 x 64 tile with 4 warps is 8,192 per dot per thread, the kernel's code
grows to match, the fp32 tiles take twice the shared memory of 16-bit ones per stage, and the
sweep did not finish compiling within 150 s on an H100. So an ieee call tries only its own
small, two-stage tiles, and of those only the ones within `IEEE_FMAS_PER_THREAD` at its head
size (`early_config_prune`, evaluated once per autotune key, which holds the head size and
the precision; Triton adds the tensors' dtypes).

Why not SDPA for fp32 instead: this keeps one attention kernel, the one the interpreter tests
check, with O(seq) memory whatever backend SDPA would pick for fp32 (its flash and cuDNN
kernels take only 16-bit inputs, so fp32 lands on memory-efficient or math attention, the
latter materialising the scores), and GQA without repeating K/V. fp32 attention on a GPU is a
debugging and reference setting; its speed matters less than its being the same kernel.
"""

from ._triton import INTERPRETED_AT_IMPORT, triton

Tile = tuple[int, int, int, int]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) of one autotune candidate."""

IEEE_FMAS_PER_THREAD = 1024
"""The most FMAs one thread may issue per fp32 (ieee) dot of a tile: 32 x 32 tiles with 4 warps
at head_dim 128, 64 x 64 with 8 warps at head_dim 64. Set from the compiled kernels
(`python tools/build_kernels.py --dtypes fp32`, sm90): at 2,048 the tiles past this bound spilled
1 KiB a thread at head_dim 64, and 2.6 to 13.4 KiB at head_dim 128 (ptxas down to 32 registers),
where they took 6 to 25 s each of the sweep's 79 s compile; within it, 31 s and at most 0.9
KiB."""

INTERPRETED_TILE = {"BLOCK_M": 32, "BLOCK_N": 32}
"""The one config under the interpreter, which cannot autotune."""

KEY = ["S", "HEAD_DIM", "CAUSAL", "PRECISION"]
"""What a kernel's best config depends on (Triton also keys on the tensors' dtypes)."""


def ieee_fmas_per_thread(tile: Tile, head_dim: int) -> int:
    """FMAs per thread of one (BLOCK_M x head_dim) @ (head_dim x BLOCK_N) ieee dot."""
    block_m, block_n, num_warps, _ = tile
    return block_m * block_n * head_dim // (32 * num_warps)


def tiles_to_try(
    tensor_core: list[Tile], ieee: list[Tile], precision: str, head_dim: int
) -> list[Tile]:
    """The candidates worth compiling for one call: the tensor-core sweep for 16-bit inputs;
    for fp32 (``precision == "ieee"``) the ieee tiles within the FMA budget at `head_dim`."""
    if precision != "ieee":
        return list(tensor_core)
    fits = [t for t in ieee if ieee_fmas_per_thread(t, head_dim) <= IEEE_FMAS_PER_THREAD]
    if not fits:
        raise ValueError(f"no ieee tile of {ieee} fits head_dim {head_dim}: add a smaller one")
    return fits


def _tile(config) -> Tile:
    kwargs = config.kwargs
    return kwargs["BLOCK_M"], kwargs["BLOCK_N"], config.num_warps, config.num_stages


def early_prune(tensor_core: list[Tile], ieee: list[Tile]):
    """Triton's ``early_config_prune`` for a kernel with these sweeps: keeps the configs
    `tiles_to_try` names for the call's PRECISION and HEAD_DIM."""

    def prune(configs: list, named_args: dict, **kwargs) -> list:
        call = {**named_args, **kwargs}
        keep = tiles_to_try(tensor_core, ieee, call["PRECISION"], call["HEAD_DIM"])
        return [c for c in configs if _tile(c) in keep]

    return prune


def autotune(tensor_core: list[Tile], ieee: list[Tile]):
    """The autotune decorator of an attention kernel: one fixed config under the interpreter,
    else both sweeps, pruned per call by `early_prune`."""
    if INTERPRETED_AT_IMPORT:
        return triton.autotune(configs=[triton.Config(INTERPRETED_TILE)], key=KEY)
    prune = {"early_config_prune": early_prune(tensor_core, ieee)}
    return triton.autotune(configs=configs(tensor_core, ieee), key=KEY, prune_configs_by=prune)


def configs(tensor_core: list[Tile], ieee: list[Tile]) -> list:
    """One Triton config per distinct tile of both sweeps."""
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in dict.fromkeys([*tensor_core, *ieee])
    ]
