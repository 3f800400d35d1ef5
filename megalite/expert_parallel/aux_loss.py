"""The routers' auxiliary losses (load balancing, z-loss) in the training objective, without
touching the loss the pipeline carries.

A block in the middle of a pipeline cannot add a term to the last stage's loss scalar. As in
Megatron-LM (`MoEAuxLossAutoScaler`), the term is attached to the block's output instead: the
forward passes the output through unchanged, and the backward, besides passing its gradient on,
gives the term the gradient it has in the objective. That gradient is the micro-batch's share
of the step (micro-batch size / global batch size, as its token losses have) times the loss
scale, set once per step by the training step (`set_step_scale`).
"""

from __future__ import annotations

import torch

_step_scale = 1.0


def set_step_scale(scale: float) -> None:
    """d(objective)/d(one micro-batch's auxiliary loss) for this step's backward passes."""
    global _step_scale
    _step_scale = scale


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_aux = torch.full(ctx.aux_shape, _step_scale, device=grad_output.device)
        return grad_output, grad_aux


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`output`, unchanged, carrying `aux_loss` (an fp32 scalar of this micro-batch) into the
    objective of the backward pass that reaches it."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return output
    return _AttachAuxLoss.apply(output, aux_loss)
