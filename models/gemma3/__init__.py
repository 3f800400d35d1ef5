"""Gemma 3 (Gemma team 2025), its text model: Llama's pieces with RMSNorms that scale by 1 +
weight (the weight initialised to 0), four of them per block around attention and the MLP
(sandwich norms), QK-norm, a GeGLU MLP (tanh-approximated GELU), the token embedding scaled by
sqrt(hidden) and tied to the head, a softmax scale of its own (`model.query_scale`), and five
sliding-window layers to one global (`model.sliding_window_pattern`) whose rotary bases
differ (`model.rope_local_theta`, 10000; `model.rope_theta`, 1e6, linearly scaled by
`model.rope_linear_factor` in 4B and up). `model.py` builds it, `hf.py` maps it to
`Gemma3ForCausalLM`, `formulas.py` counts it."""

from megalite.architectures import Architecture

ARCHITECTURE = Architecture(
    name="gemma3",
    default_ffn_hidden=lambda hidden: 4 * hidden,  # 4B, 12B, 27B (1B: 6 * hidden)
    model=f"{__name__}.model:Gemma3",
    hf=f"{__name__}.hf:MAPPING",
    formulas=f"{__name__}.formulas:FORMULAS",
    grouped_query=True,
    any_head_dim=True,
    tie_option=True,
    sliding_window=True,
    query_scale=True,
    layer_rope=True,
)
