"""Global-norm gradient clipping, folded into the optimizer's gradient scale."""

import torch


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """Factor that brings the gradient norm down to max_norm (1.0 when under it or disabled)."""
    if max_norm <= 0 or grad_norm <= max_norm:
        return 1.0
    return max_norm / (grad_norm + 1e-6)


def sum_of_squares(x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """sum(x**2) in float64 without a full-size temporary: fp32 dot products of 4096-element
    chunks (one batched matmul) summed in float64. A single fp32 dot or vector_norm over
    millions of elements is off by 1e-6..1e-4 relative, too coarse for equivalence tests."""
    whole = x.numel() // chunk * chunk
    rows = x[:whole].view(-1, 1, chunk)
    tail = x[whole:]
    return torch.bmm(rows, rows.transpose(1, 2)).double().sum() + torch.dot(tail, tail).double()
