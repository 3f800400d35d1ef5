"""Mixtral: Llama with a mixture of experts (the shared `models/moe.py`) as each block's MLP.

Read it beside models/llama/model.py: the attention, the norms, the embedding and the head are
the same shared pieces; only the block's feed-forward differs.
"""

from __future__ import annotations

from functools import partial

from megalite.models.llama.model import Block, Llama
from megalite.models.moe import MoE


class Mixtral(Llama):
    """One pipeline chunk of Mixtral: Llama's embedding, final norm and head around blocks
    whose MLP is a mixture of experts (`layers.<global index>.mlp`)."""

    block = partial(Block, mlp=MoE)
