"""Qwen3 (Qwen team 2025): Llama with RMSNorm on each head of q and k before the rotary
embedding (QK-norm), a head width that need not be hidden / n_heads (`model.head_dim`), and a
head tied to the token embedding in the smaller models (`model.tie_embeddings`).
`model.py` builds it, `hf.py` maps it to `Qwen3ForCausalLM`, `formulas.py` counts it."""

import math

from megalite.architectures import Architecture

ARCHITECTURE = Architecture(
    name="qwen3",
    default_ffn_hidden=lambda hidden: 64 * math.ceil(3 * hidden / 64),
    model=f"{__name__}.model:Qwen3",
    hf=f"{__name__}.hf:MAPPING",
    formulas=f"{__name__}.formulas:FORMULAS",
    grouped_query=True,
    any_head_dim=True,
    tie_option=True,
)
