"""Mixtral: Llama's block with a mixture of experts (`moe.MoE`) in place of the MLP.

Read it beside models/llama/model.py: the attention, the norms, the embedding and the head are
the same shared pieces; only the block's MLP differs.
"""

from __future__ import annotations

import torch
from megalite.models.layers import Attention, BuildContext, ResidualDropout, RMSNorm
from megalite.models.llama.model import Llama
from megalite.models.mixtral.moe import MoE
from torch import nn

from megalite.context_parallel.layout import SequenceLayout


class Block(nn.Module):
    """Pre-norm residual block: x + attn(rmsnorm(x)), then x + moe(rmsnorm(x))."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(ctx.cfg.hidden, ctx)
        self.attn = Attention(ctx, bias=False, rotary=True)
        self.mlp_norm = RMSNorm(ctx.cfg.hidden, ctx)
        self.moe = MoE(ctx)
        self.drop = ResidualDropout(ctx)

    def forward(self, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        h, normed = self.mlp_norm(x, residual=self.drop(self.attn(self.attn_norm(x), layout)))
        return h + self.drop(self.moe(normed))  # (b, s, h), or (b, s/tp, h) under SP


class Mixtral(Llama):
    """One pipeline chunk of Mixtral: Llama's embedding, final norm and head around MoE blocks
    (`layers.<global index>`)."""

    block = Block
