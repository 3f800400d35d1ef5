"""Qwen3: Llama's blocks with QK-norm. Read it beside models/llama/model.py: the embedding, the
norms, the MLP and the head are the same shared pieces; the attention norms each head of q and
k (`layers.Attention(qk_norm=True)`), and the head may be the embedding (`model.tie_embeddings`,
which Llama's chunk already honours)."""

from __future__ import annotations

from functools import partial

from megalite.models.llama.model import Block, Llama


class Qwen3(Llama):
    """One pipeline chunk of Qwen3: Llama's chunk around blocks whose attention has QK-norm
    (`layers.<global index>.attn.q_norm`, `.k_norm`)."""

    block = partial(Block, qk_norm=True)
