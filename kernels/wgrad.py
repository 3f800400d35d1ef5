"""Weight-gradient accumulation into an fp32 main grad, ``main_grad += dy^T x``, in Triton, with
its PyTorch reference (Megatron's gradient-accumulation fusion, ``wgrad_gemm_accum_fp32``).

Why fuse: unfused, every micro-batch's weight gradient is a 16-bit ``.grad`` (rounded to 16
bits) that is then added into the fp32 main grad: one extra gradient-sized tensor written and
read per micro-batch. The kernel reads 16-bit ``dy`` and ``x``, accumulates the GEMM in fp32
and adds straight into the main grad (or overwrites it, for the step's first micro-batch).

Tiles: (BLOCK_M output rows) x (BLOCK_N input columns) per program, looping over the tokens in
BLOCK_K steps; masked edges, so no dim needs to be a multiple of a block. Autotuned over
tensor-core tiles per shape; the main grad is restored after each trial, since the kernel adds
into it.

Which GEMM runs under ``MEGALITE_KERNELS=auto`` on CUDA: cuBLAS's fp32-output GEMM
(``torch.addmm(..., out_dtype=torch.float32)``, torch >= 2.8), which is what Megatron's own
fusion calls (cublasGemmEx with an fp32 C and beta 1) and the same arithmetic as this kernel:
16-bit products, fp32 accumulation, added in place. On an H100 (``tools/bench_kernels.py``,
8,192 tokens, bf16, the four linears of a width-4096 block) it ran at 630-700 TFLOP/s where
this kernel's first, fixed 64x64x32 tiles ran at 205-285, and the unfused 16-bit GEMM + add at
560-640. ``MEGALITE_KERNELS=triton`` forces this kernel; older torch gets it under ``auto``.
"""

import torch

from ._triton import INTERPRETED_AT_IMPORT, tl, triton
from .dispatch import requested_backend, use_triton

INTERPRETED_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
"""The one config under the interpreter, which cannot autotune."""

TENSOR_CORE_TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 32, 4, 4),
    (64, 128, 64, 4, 4),
]

CUBLAS_FP32_OUTPUT = "dtype_out" in torch.ops.aten.addmm.overloads()
"""Whether this torch has ``addmm(..., out_dtype=)`` (16-bit inputs, fp32 output; CUDA only)."""


def _configs() -> list:
    if INTERPRETED_AT_IMPORT:
        return [triton.Config(INTERPRETED_TILE)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for m, n, k, w, s in TENSOR_CORE_TILES
    ]


@triton.autotune(configs=_configs(), key=["M", "N", "K", "OVERWRITE"], restore_value=["W"])
@triton.jit
def _wgrad_kernel(
    DY, X, W, M, N, K,
    stride_dy_k, stride_dy_m, stride_x_k, stride_x_n, stride_w_m, stride_w_n,
    OVERWRITE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        # dy^T tile (BLOCK_M, BLOCK_K): element (m, k) is dy[k, m]
        a = tl.load(
            DY + k[None, :] * stride_dy_k + rm[:, None] * stride_dy_m,
            mask=(rm[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            X + k[:, None] * stride_x_k + rn[None, :] * stride_x_n,
            mask=(k[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        if UPCAST:  # the interpreter holds bf16 as raw bits: compute in fp32 there
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b)
    w_ptrs = W + rm[:, None] * stride_w_m + rn[None, :] * stride_w_n
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if not OVERWRITE:
        acc += tl.load(w_ptrs, mask=mask, other=0.0)
    tl.store(w_ptrs, acc, mask=mask)


def wgrad_accumulate_reference(
    main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool
) -> None:
    """Eager PyTorch: ``main_grad (+)= dy^T x`` in fp32, dy (tokens, out), x (tokens, in)."""
    dy, x = dy.to(main_grad.dtype), x.to(main_grad.dtype)
    if overwrite:
        torch.mm(dy.t(), x, out=main_grad)
    else:
        main_grad.addmm_(dy.t(), x)


def _launch(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool) -> None:
    (k, m), n = dy.shape, x.shape[1]

    def grid(meta):
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

    _wgrad_kernel[grid](
        dy, x, main_grad, m, n, k,
        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
        main_grad.stride(0), main_grad.stride(1),
        overwrite, INTERPRETED_AT_IMPORT,
    )  # fmt: skip


def _cublas_accumulate(
    main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool
) -> None:
    """cuBLAS: ``main_grad = dy^T x + (0 if overwrite else main_grad)``, fp32 out, in place."""
    beta = 0 if overwrite else 1
    torch.addmm(main_grad, dy.t(), x, beta=beta, out_dtype=torch.float32, out=main_grad)


def wgrad_accumulate(
    main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool = False
) -> None:
    """``main_grad += dy^T x`` (``=`` when overwrite): main_grad (out, in) fp32, dy (tokens,
    out) and x (tokens, in) in the activation dtype. The Triton kernel (and cuBLAS's fp32-output
    GEMM, which `auto` prefers on CUDA: see the module docstring) take 16-bit inputs."""
    fits = dy.ndim == x.ndim == 2 and dy.shape[0] == x.shape[0]
    fits = fits and main_grad.shape == (dy.shape[1], x.shape[1])  # never write past it
    if main_grad.dtype != torch.float32 or not fits:
        raise ValueError(
            f"main_grad {main_grad.dtype} {tuple(main_grad.shape)}, dy {tuple(dy.shape)}, "
            f"x {tuple(x.shape)}: expected fp32 (out, in), (tokens, out), (tokens, in)"
        )
    sixteen_bit = dy.dtype in (torch.float16, torch.bfloat16) and x.dtype == dy.dtype
    cublas = CUBLAS_FP32_OUTPUT and sixteen_bit and main_grad.is_cuda and dy.is_cuda and x.is_cuda
    if cublas and requested_backend() == "auto":
        _cublas_accumulate(main_grad, dy, x, overwrite)
    elif use_triton(main_grad, dy, x, unsupported=None if sixteen_bit else f"{dy.dtype} inputs"):
        _launch(main_grad, dy, x, overwrite)
    else:
        wgrad_accumulate_reference(main_grad, dy, x, overwrite)
