"""Qwen3-MoE: Llama's chunk around blocks with Qwen3's attention (QK-norm) and a mixture of
experts as the MLP. Read it beside models/qwen3/model.py and models/mixtral/model.py: it is
the one block with both of their options."""

from __future__ import annotations

from functools import partial

from megalite.models.llama.model import Block, Llama
from megalite.models.moe import MoE


class Qwen3MoE(Llama):
    """One pipeline chunk of Qwen3-MoE (`layers.<global index>.attn.q_norm`, `.mlp.router`,
    `.mlp.experts`...)."""

    block = partial(Block, mlp=MoE, qk_norm=True)
