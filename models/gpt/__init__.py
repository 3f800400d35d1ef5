"""GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm blocks, tanh-GELU MLP of width
4h, biases everywhere, an LM head tied to the token embedding, no grouped-query attention.
`model.py` builds it, `hf.py` maps it to `GPT2LMHeadModel`, `formulas.py` counts it."""

from megalite.architectures import Architecture

ARCHITECTURE = Architecture(
    name="gpt",
    default_ffn_hidden=lambda hidden: 4 * hidden,
    model=f"{__name__}.model:GPT",
    hf=f"{__name__}.hf:MAPPING",
    formulas=f"{__name__}.formulas:FORMULAS",
)
