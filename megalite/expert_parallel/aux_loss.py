"""The routers' auxiliary losses (load balancing, z-loss) in the training objective, without
touching the loss the pipeline carries.

A block in the middle of a pipeline cannot add a term to the last stage's loss scalar. As in
Megatron-LM (`MoEAuxLossAutoScaler`), the term is attached to the block's output instead: the
forward passes the output through unchanged, and the backward, besides passing its gradient on,
gives the term the gradient it has in the objective. That gradient is the micro-batch's share
of the step (micro-batch size / global batch size, as its token losses have) times the loss
scale: a tensor the layer owns, which the training step fills in once per step and the forward
passes in, so it reaches backward explicitly, and a compiled block reads it as an input (a new
loss scale compiles nothing).
"""

from __future__ import annotations

import torch


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        ctx.save_for_backward(scale)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return grad_output, scale.expand(ctx.aux_shape).clone(), None


def attach_aux_loss(
    output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """`output`, unchanged, carrying `aux_loss` (an fp32 scalar of this micro-batch) into the
    objective of the backward pass that reaches it, with the gradient `scale` (an fp32 scalar:
    d(objective)/d(aux_loss) for this step, as the training step set it)."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return output
    return _AttachAuxLoss.apply(output, aux_loss, scale)
