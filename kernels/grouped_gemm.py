"""Grouped GEMM for mixture-of-experts layers, ``y[rows of g] = x[rows of g] @ weight[g]^T``, in
Triton, with its PyTorch reference (one GEMM per group).

Why a kernel: an MoE layer hands each expert its tokens, sorted by expert, and how many each
expert gets changes every micro-batch. The loop of one GEMM per expert launches a GEMM per
group (three with backward), each too small to fill a GPU when the tokens spread over many
experts, and must read the counts on the host to split the rows: a synchronisation per call.
Here each product is one launch over all groups, and the counts never leave the device.

Layout: x (rows, in) with rows sorted by group, weight (groups, out, in) (nn.Linear's per
group), counts (groups,) on x's device. Forward and dx share the row kernel: a program computes
a (BLOCK_M rows x BLOCK_N columns) tile of one group, ``a_g @ b_g`` over the reduction in
BLOCK_K steps, reading b_g through strides as weight[g]^T (forward) or weight[g] (dx). No tile
straddles two groups: group g gets cdiv(counts[g], BLOCK_M) row tiles, and a tile-to-group map
built with torch ops on the device (cumsum, searchsorted) names each program's group. The grid
comes from the bound cdiv(rows, BLOCK_M) + groups on the tiles, so no count is read on the
host; programs past the last tile exit. dweight has its own kernel: one program per (group,
BLOCK_N x BLOCK_K tile of weight[g]), looping over the group's rows, so a group with no rows
gets exact zeros. Every edge is masked: no dim needs to be a multiple of a block. Offsets into
a tensor are int64 (the group, row and column indices are, before a stride multiplies them): a
weight of 2^31 elements or more would wrap an int32 product.

Tiles: BLOCK_M is the map's granularity, so the host picks it per call (`_block_m`) before the
map is built; the other blocks are autotuned, keyed on the features and the dtype (never on
rows, which change every micro-batch). 16-bit inputs sweep tensor-core tiles; fp32 inputs get
true fp32 products (``input_precision="ieee"``, FMAs on the CUDA cores, see
:mod:`megalite.kernels.autotune`) and sweep only small two-stage tiles within its FMA budget.
Neither sweep has been timed on a GPU yet.

Without Triton (CPU, or ``MEGALITE_KERNELS=torch``) `grouped_mm_torch` runs: torch's own
grouped GEMM over the counts' running sums, which no host read precedes either, so a step counts
the same host syncs on CPU as on a GPU (none). `grouped_mm_reference`, one GEMM per group over
rows split on the host, is the baseline both are held to (tests, `megalite.benchmarks.moe`).

``sum(counts) == rows`` is checked on CPU tensors, by `torch._assert_async` (on CPU it raises at
once; it reads the counts as no CUDA stream would wait for). On CUDA it is not checked: rows
past the sum are left unwritten, and whatever the counts, no row outside x is read or written.
Under the Triton interpreter 16-bit values are held as raw bits, so the kernels widen their
loads to fp32 there (``UPCAST``).
"""

import torch
import torch.nn.functional as F

from ._triton import INTERPRETED_AT_IMPORT, tl, triton
from .dispatch import opaque, use_triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tiles each kernel autotunes over: tensor-core tiles for 16-bit inputs, then small two-stage
# ones for fp32, all within autotune.IEEE_FMAS_PER_THREAD (tests/kernels/test_grouped_gemm.py).
# Row kernel (forward and dx): (BLOCK_N, BLOCK_K, num_warps, num_stages), BLOCK_M `_block_m`'s.
ROW_TILES = (
    [(128, 64, 4, 4), (128, 64, 8, 3), (256, 64, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4)],
    [(64, 32, 4, 2), (128, 32, 8, 2), (32, 32, 4, 2)],
)
# dweight: (BLOCK_N out, BLOCK_K in, BLOCK_M rows per step, num_warps, num_stages).
DWEIGHT_TILES = (
    [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 32, 4, 4),
     (64, 128, 64, 4, 4)],
    [(64, 64, 32, 4, 2), (32, 64, 32, 4, 2), (64, 32, 32, 4, 2)],
)  # fmt: skip

IEEE_BLOCK_M = 64
"""The row kernel's BLOCK_M for fp32 inputs."""

INTERPRETED_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
"""The one tile under the interpreter, which cannot autotune."""


def _autotune(tensor_core: list[tuple], ieee: list[tuple], names: tuple[str, ...], key: list):
    """One fixed config under the interpreter; else both sweeps (tiles named by `names`, then
    warps and stages), each call pruned to the tensor-core one or, for fp32 (PRECISION ieee),
    the ieee one."""
    if INTERPRETED_AT_IMPORT:
        fixed = {name: INTERPRETED_TILE[name] for name in names}
        return triton.autotune(configs=[triton.Config(fixed)], key=key)

    def config(tile: tuple):
        *blocks, warps, stages = tile
        return triton.Config(dict(zip(names, blocks)), num_warps=warps, num_stages=stages)

    sweeps = {"tf32": [config(t) for t in tensor_core], "ieee": [config(t) for t in ieee]}

    def prune(configs: list, named_args: dict, **kwargs) -> list:
        keep = sweeps[{**named_args, **kwargs}["PRECISION"]]
        return [c for c in configs if c in keep]

    return triton.autotune(
        configs=[*sweeps["tf32"], *sweeps["ieee"]],
        key=key,
        prune_configs_by={"early_config_prune": prune},
    )


@_autotune(*ROW_TILES, names=("BLOCK_N", "BLOCK_K"), key=["N", "K", "BLOCK_M"])
@triton.jit
def _rows_kernel(
    A, B, OUT, TILE_GROUP, FIRST_TILE, OFFSETS, N, K, GROUPS,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_om, stride_on,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """OUT[rows] = A[rows] @ B[g] (K x N, by strides) for the row tile the map gives this
    program: rows from the tile's first to the group's end, at most BLOCK_M of them."""
    tile = tl.program_id(0)
    g = tl.load(TILE_GROUP + tile)  # int64, as the map holds it: g * stride_bg cannot wrap
    if g >= GROUPS:  # past the last tile: the grid is an upper bound
        return
    start = tl.load(OFFSETS + g) + (tile - tl.load(FIRST_TILE + g)) * BLOCK_M
    end = tl.load(OFFSETS + g + 1)
    rm = start + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    b_group = B + g * stride_bg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(
            A + rm[:, None] * stride_am + k[None, :] * stride_ak,
            mask=(rm[:, None] < end) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_group + k[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=(k[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    out_ptrs = OUT + rm[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=(rm[:, None] < end) & (rn[None, :] < N))


@_autotune(*DWEIGHT_TILES, names=("BLOCK_N", "BLOCK_K", "BLOCK_M"), key=["N", "K"])
@triton.jit
def _dweight_kernel(
    DY, X, DW, OFFSETS, N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_wg, stride_wn, stride_wk,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """DW[g] = DY[rows of g]^T @ X[rows of g], one (BLOCK_N x BLOCK_K) tile per program."""
    g = tl.program_id(0).to(tl.int64)  # g * stride_wg passes 2^31 in a large weight
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(2).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    end = tl.load(OFFSETS + g + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(tl.load(OFFSETS + g), end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        # dy^T tile (BLOCK_N, BLOCK_M): element (n, m) is dy[m, n]
        dy_t = tl.load(
            DY + m[None, :] * stride_dym + rn[:, None] * stride_dyn,
            mask=(m[None, :] < end) & (rn[:, None] < N),
            other=0.0,
        )
        x = tl.load(
            X + m[:, None] * stride_xm + rk[None, :] * stride_xk,
            mask=(m[:, None] < end) & (rk[None, :] < K),
            other=0.0,
        )
        if UPCAST:
            dy_t, x = dy_t.to(tl.float32), x.to(tl.float32)
        acc += tl.dot(dy_t, x, input_precision=PRECISION)
    dw_ptrs = DW + g * stride_wg + rn[:, None] * stride_wn + rk[None, :] * stride_wk
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))


def _precision(x: torch.Tensor) -> str:
    # fp32 inputs get true fp32 products (as torch does by default), not TF32.
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _block_m(rows: int, groups: int, dtype: torch.dtype) -> int:
    """Rows per row tile: 128 for 16-bit inputs when the groups average 128 rows or more, else
    64 (fewer masked rows in each group's last tile); the interpreter's fixed tile."""
    if INTERPRETED_AT_IMPORT:
        return INTERPRETED_TILE["BLOCK_M"]
    if dtype == torch.float32:
        return IEEE_BLOCK_M
    return 128 if rows >= 128 * groups else 64


def _group_ends(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """(groups,) int64: where each group's rows end, from int64 `counts` clamped at zero (a
    negative count reads as none). The ends stop at `rows`, so counts that sum past it cannot
    send a product outside x."""
    return counts.cumsum(0).clamp_(max=rows)


def _tile_map(
    counts: torch.Tensor, rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_group, first_tile, offsets), int64 on counts' device, no host synchronisation.

    offsets (groups + 1): where each group's rows begin (`_group_ends`, after a 0). first_tile
    (groups + 1): each group's first row tile (the last entry: the total). tile_group (one per
    program of the row grid): the group of that tile, ``groups`` for programs past the last
    tile."""
    counts = counts.long().clamp(min=0)
    offsets = F.pad(_group_ends(counts, rows), (1, 0))
    tile_end = torch.div(counts + block_m - 1, block_m, rounding_mode="floor").cumsum(0)
    tiles = torch.arange(triton.cdiv(rows, block_m) + counts.numel(), device=counts.device)
    tile_group = torch.searchsorted(tile_end, tiles, right=True)
    return tile_group, F.pad(tile_end, (1, 0)), offsets


def _grouped_rows(
    a: torch.Tensor, weight: torch.Tensor, tile_map: tuple, block_m: int, transpose: bool
) -> torch.Tensor:
    """Per group, ``a_g @ weight[g]^T`` (forward: a is x) or, with `transpose`, ``a_g @
    weight[g]`` (dx: a is dy)."""
    groups, out_features, in_features = weight.shape
    n, k = (in_features, out_features) if transpose else (out_features, in_features)
    out = torch.empty((a.shape[0], n), device=a.device, dtype=a.dtype)
    if out.numel() == 0:
        return out
    stride_bk, stride_bn = weight.stride(2), weight.stride(1)  # b[k, n] = weight[g, n, k]
    if transpose:  # b[k, n] = weight[g, k, n]
        stride_bk, stride_bn = stride_bn, stride_bk
    tile_group, first_tile, offsets = tile_map

    def grid(meta):
        return tile_group.numel(), triton.cdiv(n, meta["BLOCK_N"])

    _rows_kernel[grid](
        a, weight, out, tile_group, first_tile, offsets, n, k, groups,
        a.stride(0), a.stride(1), weight.stride(0), stride_bk, stride_bn,
        out.stride(0), out.stride(1),
        UPCAST=INTERPRETED_AT_IMPORT, PRECISION=_precision(a), BLOCK_M=block_m,
    )  # fmt: skip
    return out


def _grouped_dweight(
    dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, dw: torch.Tensor
) -> torch.Tensor:
    """Per group, ``dy_g^T @ x_g`` into `dw` (groups, out, in), through its strides (zeros for
    a group with no rows); returns `dw`."""
    if x.shape[0] == 0:
        return dw.zero_()
    groups, n, k = dw.shape

    def grid(meta):
        return groups, triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"])

    _dweight_kernel[grid](
        dy, x, dw, offsets, n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        UPCAST=INTERPRETED_AT_IMPORT, PRECISION=_precision(x),
    )  # fmt: skip
    return dw


class GroupedMMFunction(torch.autograd.Function):
    """Triton grouped GEMM; saves x, weight and the tile map, never reads counts on the host."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        block_m = _block_m(x.shape[0], weight.shape[0], x.dtype)
        tile_map = _tile_map(counts, x.shape[0], block_m)
        ctx.save_for_backward(x, weight, *tile_map)
        ctx.block_m = block_m
        return _grouped_rows(x, weight, tile_map, block_m, transpose=False)

    @staticmethod
    def backward(ctx, dy):
        x, weight, *tile_map = ctx.saved_tensors
        dx = dweight = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_rows(dy, weight, tile_map, ctx.block_m, transpose=True)
        if ctx.needs_input_grad[1]:
            dweight = _grouped_dweight(dy, x, tile_map[2], torch.empty_like(weight))
        return dx, dweight, None


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` as ``torch._grouped_mm`` reads it: contiguous, from a 16-byte aligned address."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _TorchGroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` over the groups' row `ends` (int32), and its backward by the same
    op. Torch's own backward takes only a gradient whose strides are 16-byte multiples, which a
    broadcast one (from ``y.sum()``, stride 0) or a transposed one is not: here it is made
    contiguous first."""

    @staticmethod
    def forward(ctx, x, weight, ends):
        x, weight = _aligned(x), _aligned(weight)
        ctx.save_for_backward(x, weight, ends)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, dy):
        x, weight, ends = ctx.saved_tensors
        dy = _aligned(dy)
        dx = dweight = None
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dy, weight, offs=ends)
        if ctx.needs_input_grad[1]:
            dweight = torch._grouped_mm(dy.t(), x, offs=ends)  # (groups, out, in)
        return dx, dweight, None


def _masked_per_group(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """One GEMM per group over every row, each row taking its own group's product: `groups`
    times the work, but no host read, for what ``torch._grouped_mm`` does not take. Rows past
    the last end are zero."""
    group = torch.searchsorted(ends, torch.arange(x.shape[0], device=x.device), right=True)
    y = x.new_zeros(x.shape[0], weight.shape[1])
    for g, weight_g in enumerate(weight):
        y = torch.where((group == g).unsqueeze(1), x @ weight_g.t(), y)
    return y


def grouped_mm_torch(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` in PyTorch, with no host read of the counts: ``torch._grouped_mm`` where it
    takes the inputs (fp32, bf16 or fp16, and in and out features that are 16-byte multiples,
    as its strides must be), else `_masked_per_group`."""
    ends = _group_ends(counts.long().clamp(min=0), x.shape[0])
    alignment = 16 // x.element_size()
    features = (weight.shape[1], weight.shape[2])
    if x.dtype in SUPPORTED_DTYPES and all(f % alignment == 0 for f in features):
        return _TorchGroupedMM.apply(x, weight, ends.int())
    return _masked_per_group(x, weight, ends)


def _masked_weight_grad(dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per group dy_g^T x_g over every row, the other groups' rows masked to zero: `groups`
    GEMMs, no host read (what ``torch._grouped_mm`` does not take)."""
    group = torch.searchsorted(ends, torch.arange(x.shape[0], device=x.device), right=True)
    return torch.stack(
        [torch.where((group == g).unsqueeze(1), dy, 0).t() @ x for g in range(ends.numel())]
    )


def grouped_weight_grad(dy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``dw[g] = dy[rows of g]^T @ x[rows of g]``, (groups, out, in) in x's dtype: the weight
    gradient of `grouped_mm` on its own, for a backward that casts its operands first (float8
    experts, `megalite.float8.experts`). dy (rows, out) and x (rows, in) sorted by group,
    counts as `grouped_mm`'s; a group with no rows gets zeros. No host read of the counts."""
    groups, rows = counts.numel(), x.shape[0]
    counts = counts.long().clamp(min=0)
    if use_triton(dy, x, counts, unsupported=_unsupported(x)):
        offsets = F.pad(_group_ends(counts, rows), (1, 0))
        dw = torch.empty((groups, dy.shape[1], x.shape[1]), device=x.device, dtype=x.dtype)
        return _grouped_dweight(dy, x, offsets, dw)
    ends = _group_ends(counts, rows)
    alignment = 16 // x.element_size()
    if x.dtype in SUPPORTED_DTYPES and all(f % alignment == 0 for f in (dy.shape[1], x.shape[1])):
        return torch._grouped_mm(_aligned(dy).t(), _aligned(x), offs=ends.int())
    return _masked_weight_grad(dy, x, ends)


def grouped_mm_reference(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """One GEMM per group over ``x.split(counts.tolist())``, plain autograd: the per-expert loop
    the grouped paths are held to (tests, `megalite.benchmarks.moe`). It reads the counts on
    the host: on a GPU, a synchronisation per call."""
    return torch.cat([x_g @ w_g.t() for x_g, w_g in zip(x.split(counts.tolist()), weight)])


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> None:
    if x.ndim != 2 or weight.ndim != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"expected x (rows, in) and weight (groups, out, in); got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if counts.shape != weight.shape[:1] or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"counts must be an int32 or int64 tensor of shape (groups,) = ({weight.shape[0]},); "
            f"got {counts.dtype} {tuple(counts.shape)}"
        )
    if counts.device != x.device or weight.device != x.device:
        raise ValueError(
            f"x, weight and counts must be on one device; got {x.device}, {weight.device}, "
            f"{counts.device}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight dtypes differ: {x.dtype}, {weight.dtype}")


def _check_counts(counts: torch.Tensor, rows: int) -> None:
    """None negative and ``sum(counts) == rows``, on CPU tensors: `torch._assert_async` raises
    there at once, with no host read that a GPU would wait for. Not on CUDA, where a failed
    device-side assert would end the process (the kernels keep inside x instead)."""
    if not counts.is_cuda:
        valid = (counts >= 0).all() & (counts.sum() == rows)
        torch._assert_async(valid, f"counts must be >= 0 and sum to the rows of x, {rows}")


def _unsupported(x: torch.Tensor) -> str | None:
    return None if x.dtype in SUPPORTED_DTYPES else f"dtype {x.dtype}"


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ weight[g]^T`` for rows sorted by group.

    x: (rows, in); weight: (groups, out, in); counts: (groups,) int32/int64 on x's device, the
    rows of each group in order (zero allowed), summing to rows. Returns (rows, out) in x's
    dtype, accumulated in fp32; differentiable in x and weight.
    """
    _check_inputs(x, weight, counts)
    _check_counts(counts, x.shape[0])
    if use_triton(x, weight, counts, unsupported=_unsupported(x)):
        return opaque(GroupedMMFunction.apply)(x, weight, counts)
    return grouped_mm_torch(x, weight, counts)
