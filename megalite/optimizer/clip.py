"""Global-norm gradient clipping, folded into the optimizer's gradient scale."""

import torch


def clip_coefficient(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor | float:
    """Factor that brings the gradient norm down to max_norm (1.0 when under it, or disabled),
    on the norm's device: torch.nn.utils.clip_grad_norm_'s, max_norm / (norm + 1e-6) at most 1."""
    if max_norm <= 0:
        return 1.0
    return (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)


def sums_of_squares(pieces: list[torch.Tensor], membership: torch.Tensor) -> torch.Tensor:
    """sum(x**2) over the pieces of each group, in float64 (`membership`: (pieces, groups),
    1.0 where a piece is the group's): one foreach norm, each piece's accumulated in float64
    (a single fp32 dot or vector_norm over millions of elements is off by 1e-6..1e-4 relative,
    too coarse for equivalence tests), then the squares summed by group in one product, in a
    fixed order (atomics would make the sum differ from run to run)."""
    if not pieces:
        return membership.new_zeros(membership.shape[1])
    squares = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square_()
    return squares @ membership
