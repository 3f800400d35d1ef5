"""Mistral 7B (Jiang et al. 2023): Llama with sliding-window attention, each token attending to
itself and the `model.sliding_window` - 1 tokens before it (4096 in v0.1; null, full attention,
from v0.2), and a head width of its own where the config says (Mistral NeMo: 128 at hidden
5120). `model.py` builds it, `hf.py` maps it to `MistralForCausalLM`, `formulas.py` counts it."""

from megalite.architectures import Architecture

ARCHITECTURE = Architecture(
    name="mistral",
    default_ffn_hidden=lambda hidden: 7 * hidden // 2,  # Mistral 7B: 14336 at 4096
    model=f"{__name__}.model:Mistral",
    hf=f"{__name__}.hf:MAPPING",
    formulas=f"{__name__}.formulas:FORMULAS",
    grouped_query=True,
    any_head_dim=True,
    sliding_window=True,
)
