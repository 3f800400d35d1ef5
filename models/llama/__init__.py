"""Llama (Touvron et al. 2023): RMSNorm, rotary position embeddings (with Llama 3.1's scaling
under `model.rope_scaling=llama3`), SwiGLU MLP of width 8/3 h (rounded up to a multiple of 64),
grouped-query attention, no biases, an untied LM head.
`model.py` builds it, `hf.py` maps it to `LlamaForCausalLM`, `formulas.py` counts it."""

import math

from megalite.architectures import Architecture

ARCHITECTURE = Architecture(
    name="llama",
    default_ffn_hidden=lambda hidden: 64 * math.ceil(8 * hidden / 3 / 64),
    model=f"{__name__}.model:Llama",
    hf=f"{__name__}.hf:MAPPING",
    formulas=f"{__name__}.formulas:FORMULAS",
    grouped_query=True,
    rope_scaling=True,
)
