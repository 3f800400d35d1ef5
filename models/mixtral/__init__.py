"""Mixtral (Jiang et al. 2024): Llama's attention, norms and rotary embeddings with a mixture of
SwiGLU experts in place of each MLP (the shared block `models/moe.py`), top-k routed;
DeepSeek-V3's sigmoid router with bias balancing and shared experts as options (`model.moe_*`).
`model.py` builds it, `hf.py` maps it to `MixtralForCausalLM`, `formulas.py` counts it."""

import math

from megalite.architectures import Architecture

ARCHITECTURE = Architecture(
    name="mixtral",
    default_ffn_hidden=lambda hidden: 64 * math.ceil(7 * hidden / 2 / 64),
    model=f"{__name__}.model:Mixtral",
    hf=f"{__name__}.hf:MAPPING",
    formulas=f"{__name__}.formulas:FORMULAS",
    grouped_query=True,
    rope_scaling=True,
    mixture_of_experts=True,
)
