"""LayerNorm and RMSNorm fused with the residual add, in Triton, with their PyTorch references.

Why fuse: a pre-norm block ends its attention half with ``h = x + residual`` and starts its MLP
half with ``norm(h)``. Eager PyTorch reads and writes the (tokens, hidden) stream once for the
add and again for the norm (RMSNorm in fp32 writes an fp32 copy and the normalised tensor
besides). The kernel reads x and the residual once and writes h (the new residual stream) and
``y = norm(h) * weight (+ bias)`` once; it keeps h and one or two fp32 statistics per row
(mean, 1/std) for backward, where the gradient of h flows to both x and the residual.

One program normalises one row (the whole hidden dim in one block, the ragged end masked).
Backward: each program walks a contiguous run of rows, writes their dx, and accumulates the
weight and bias gradients of its rows in fp32; a tiny (programs, hidden) sum finishes them, so
there are no atomics (as flash-attn's Triton layer norm does). All math is fp32 whatever the
input dtype; RMSNorm rounds the normalised row to the input dtype before the weight, as the
models' RMSNorm always did (and Hugging Face's Llama does).
"""

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .dispatch import opaque, use_triton

MAX_ROW_BYTES = 65536  # one row (padded to a power of two) must fit one block
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _norm_fwd_kernel(X, RES, H, W, B, Y, MEAN, RSTD, N, eps, HAS_RESIDUAL: tl.constexpr,
                     HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
                     BLOCK_N: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    offs = row * N + cols
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(H.dtype.element_ty)  # the stream is stored in its dtype: normalise what is kept
        tl.store(H + offs, h, mask=mask)
        h = h.to(tl.float32)
    if IS_RMS:
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        xhat = (h * rstd).to(H.dtype.element_ty).to(tl.float32)  # rounded as the model does
    else:
        mean = tl.sum(h, axis=0) / N
        centred = tl.where(mask, h - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / N + eps)
        tl.store(MEAN + row, mean)
        xhat = centred * rstd
    tl.store(RSTD + row, rstd)
    y = xhat * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(H, W, MEAN, RSTD, DY, DH_OUT, DX, DW_PARTIAL, DB_PARTIAL, M, N,
                     rows_per_program, HAS_DH: tl.constexpr, HAS_BIAS: tl.constexpr,
                     IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, M)):
        offs = row * N + cols
        h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)  # 0 past N: so are sums
        rstd = tl.load(RSTD + row)
        wdy = w * dy
        if IS_RMS:
            xhat = h * rstd
            dh = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N)) * rstd
            xhat = xhat.to(H.dtype.element_ty).to(tl.float32)  # what forward multiplied by w
        else:
            xhat = (h - tl.load(MEAN + row)) * rstd
            c1, c2 = tl.sum(xhat * wdy, axis=0) / N, tl.sum(wdy, axis=0) / N
            dh = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DH:  # the gradient of h itself, from its later uses in the residual stream
            dh += tl.load(DH_OUT + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dh.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid * N + cols, db, mask=mask)


def _launch_options(n: int) -> dict[str, int]:
    """One power-of-two block per row; more warps for wider rows (flash-attn's choice)."""
    block = triton.next_power_of_2(n)
    return dict(BLOCK_N=block, num_warps=min(max(block // 256, 1), 8))


def _backward_programs(rows: int, device: torch.device) -> int:
    """How many programs share the rows in backward: enough to fill a GPU, few enough that the
    (programs, hidden) partial sums stay small."""
    if device.type == "cuda":
        return min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(rows, 4)  # the interpreter runs programs one after another


class AddNormFunction(torch.autograd.Function):
    """Triton residual add + LayerNorm / RMSNorm. Returns y, or (h, y) with a residual; saves
    h, the parameters and fp32 (mean,) 1/std per row."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms):
        n = x.shape[-1]
        x2d = x.contiguous().view(-1, n)  # (rows, hidden)
        # the kernels index the parameters as contiguous: a strided view (a column of a
        # stacked tensor) would be read wrongly
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        m = x2d.shape[0]
        stats = dict(device=x.device, dtype=torch.float32)
        rstd = torch.empty(m, **stats)
        mean = rstd if rms else torch.empty(m, **stats)  # RMSNorm has no mean: never touched
        if residual is None:
            res2d, h2d = x2d, x2d
        else:
            res2d, h2d = residual.contiguous().view(m, n), torch.empty_like(x2d)
        # the references' dtypes: F.layer_norm keeps x's (fp32 parameters on 16-bit x too),
        # RMSNorm's product with the weight promotes
        dtype = torch.result_type(x, weight) if rms else x.dtype
        y = torch.empty((m, n), device=x.device, dtype=dtype)
        _norm_fwd_kernel[(m,)](
            x2d, res2d, h2d, weight, weight if bias is None else bias, y, mean, rstd, n, eps,
            residual is not None, bias is not None, rms, **_launch_options(n),
        )  # fmt: skip
        ctx.save_for_backward(h2d, weight, bias, None if rms else mean, rstd)
        ctx.rms, ctx.has_residual, ctx.shape = rms, residual is not None, x.shape
        ctx.set_materialize_grads(False)  # h's gradient may be None: no zeros to read
        if residual is None:
            return y.view(x.shape)
        return h2d.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, *grads):
        dh_out, dy = grads if ctx.has_residual else (None, grads[0])
        h2d, weight, bias, mean, rstd = ctx.saved_tensors
        m, n = h2d.shape
        dy = torch.zeros_like(h2d) if dy is None else dy.contiguous().view(m, n)
        dh_out = None if dh_out is None else dh_out.contiguous().view(m, n)
        programs = max(_backward_programs(m, h2d.device), 1)
        rows_per_program = max(triton.cdiv(m, programs), 1)
        programs = triton.cdiv(m, rows_per_program)  # 0 without rows: zero dw and db
        dx = torch.empty_like(h2d)
        dw_partial = torch.empty((programs, n), device=h2d.device, dtype=torch.float32)
        db_partial = dw_partial if bias is None else torch.empty_like(dw_partial)
        _norm_bwd_kernel[(programs,)](
            h2d, weight, rstd if mean is None else mean, rstd, dy,
            dy if dh_out is None else dh_out, dx, dw_partial, db_partial, m, n,
            rows_per_program, dh_out is not None, bias is not None, ctx.rms,
            **_launch_options(n),
        )  # fmt: skip
        dx = dx.view(ctx.shape)
        dweight = dw_partial.sum(0).to(weight.dtype)
        dbias = None if bias is None else db_partial.sum(0).to(bias.dtype)
        return dx, dx if ctx.has_residual else None, dweight, dbias, None, None


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager PyTorch: ``h = x + residual`` (x without one), ``(h, layer_norm(h))``."""
    h = x if residual is None else x + residual
    return h, F.layer_norm(h, h.shape[-1:], weight, bias, eps)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager PyTorch: ``h = x + residual`` (x without one), ``(h, h / rms(h) * weight)`` with
    the normalisation in fp32 and rounded to h's dtype before the weight (Llama's RMSNorm)."""
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return h, hf.to(h.dtype) * weight


def _unsupported(x: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take x, or None when it can."""
    if x.dtype not in SUPPORTED_DTYPES:
        return f"{x.dtype} inputs"
    if triton.next_power_of_2(x.shape[-1]) * x.element_size() > MAX_ROW_BYTES:
        return f"hidden size {x.shape[-1]} in {x.dtype} (a row must fit {MAX_ROW_BYTES} bytes)"
    return None


def _check(x: torch.Tensor, residual: torch.Tensor | None, *params: torch.Tensor | None) -> None:
    for p in params:
        if p is not None and tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"norm parameter {tuple(p.shape)} must be ({x.shape[-1]},)")
    if residual is not None and (residual.shape, residual.dtype) != (x.shape, x.dtype):
        raise ValueError(
            f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} "
            f"{tuple(x.shape)}"
        )


def _add_norm(x, residual, weight, bias, eps, rms):
    """(h, y) through the Triton Function (opaque to torch.compile)."""
    out = opaque(AddNormFunction.apply)(x, residual, weight, bias, eps, rms)
    return (x, out) if residual is None else out


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, layer_norm(h) * weight + bias)`` with ``h = x + residual`` (h is x without a
    residual): the residual add and the norm of a pre-norm block in one pass. x (..., hidden)."""
    _check(x, residual, weight, bias)
    tensors = [t for t in (x, residual, weight, bias) if t is not None]
    if use_triton(*tensors, unsupported=_unsupported(x), fusable=True):
        return _add_norm(x, residual, weight, bias, eps, rms=False)
    return layer_norm_reference(x, weight, bias, eps, residual)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, h / rms(h) * weight)`` with ``h = x + residual`` (h is x without a residual), the
    normalisation in fp32: the residual add and Llama's RMSNorm in one pass."""
    _check(x, residual, weight)
    tensors = [t for t in (x, residual, weight) if t is not None]
    if use_triton(*tensors, unsupported=_unsupported(x), fusable=True):
        return _add_norm(x, residual, weight, None, eps, rms=True)
    return rms_norm_reference(x, weight, eps, residual)
