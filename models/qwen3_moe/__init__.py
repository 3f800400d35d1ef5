"""Qwen3-MoE (Qwen team 2025): Qwen3's attention (QK-norm, its own head width, optionally a tied
head) with the shared mixture of experts (`models/moe.py`) in place of each MLP, top-k of the
softmax router with the gates renormalised over the k (Hugging Face's `norm_topk_prob`), no
shared experts. `model.py` builds it, `hf.py` maps it to `Qwen3MoeForCausalLM`, `formulas.py`
counts it."""

import math

from megalite.architectures import Architecture

ARCHITECTURE = Architecture(
    name="qwen3_moe",
    default_ffn_hidden=lambda hidden: 64 * math.ceil(3 * hidden / 4 / 64),
    model=f"{__name__}.model:Qwen3MoE",
    hf=f"{__name__}.hf:MAPPING",
    formulas=f"{__name__}.formulas:FORMULAS",
    grouped_query=True,
    any_head_dim=True,
    tie_option=True,
    mixture_of_experts=True,
)
