"""Global-norm gradient clipping, folded into the optimizer's gradient scale."""


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """Factor that brings the gradient norm down to max_norm (1.0 when under it or disabled)."""
    if max_norm <= 0 or grad_norm <= max_norm:
        return 1.0
    return max_norm / (grad_norm + 1e-6)
