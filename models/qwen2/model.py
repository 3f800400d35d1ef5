"""Qwen2: Llama's blocks with q, k and v biases (`layers.Attention(qkv_bias=True)`); read it
beside models/llama/model.py."""

from __future__ import annotations

from functools import partial

from megalite.models.llama.model import Block, Llama


class Qwen2(Llama):
    """One pipeline chunk of Qwen2 (`layers.<global index>.attn.wq.bias`...)."""

    block = partial(Block, qkv_bias=True)
