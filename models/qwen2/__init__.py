"""Qwen2 and Qwen2.5 (Qwen team 2024): Llama with biases on the q, k and v projections (not on
the output projection), and in the smaller models a head tied to the token embedding
(`model.tie_embeddings`). `model.py` builds it, `hf.py` maps it to `Qwen2ForCausalLM`,
`formulas.py` counts it."""

import math

from megalite.architectures import Architecture

ARCHITECTURE = Architecture(
    name="qwen2",
    default_ffn_hidden=lambda hidden: 64 * math.ceil(16 * hidden / 3 / 64),
    model=f"{__name__}.model:Qwen2",
    hf=f"{__name__}.hf:MAPPING",
    formulas=f"{__name__}.formulas:FORMULAS",
    grouped_query=True,
    tie_option=True,
)
