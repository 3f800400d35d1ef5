"""Global-norm gradient clipping, folded into the optimizer's gradient scale."""

import torch


def clip_coefficient(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor | float:
    """Factor that brings the gradient norm down to max_norm (1.0 when under it or disabled),
    on the norm's device."""
    if max_norm <= 0:
        return 1.0
    return torch.where(grad_norm <= max_norm, 1.0, max_norm / (grad_norm + 1e-6))


def sum_of_squares(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """sum(x**2) over all `pieces`, in float64: one foreach norm, each piece's accumulated in
    float64 (a single fp32 dot or vector_norm over millions of elements is off by 1e-6..1e-4
    relative, too coarse for equivalence tests), then the squares summed. 0 without pieces."""
    if not pieces:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(pieces, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()
