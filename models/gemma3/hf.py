"""Gemma 3 as Hugging Face's `Gemma3ForCausalLM` (model_type gemma3_text): Llama's tensors
under their names, each block's four norms and QK-norms, a tied head, and the config both ways.
The norm weights are stored as they are (Hugging Face's norms scale by 1 + weight too).

The layer pattern and rotary settings travel in either transformers' form: 4 writes
`sliding_window_pattern` (layer_types from 4.53), `rope_theta`, `rope_local_base_freq` and the
global layers' `rope_scaling`; 5 `layer_types` and one `rope_parameters` per layer type.
Linear rope scaling of the global layers comes in as `model.rope_linear_factor`; other rope
types, logit or attention softcapping, bidirectional attention, biases and activations other
than gelu_pytorch_tanh are refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megalite.models.hugging_face import Link
from megalite.models.llama.hf import LlamaMapping

from megalite.config import ROPE_SCALING_KEYS, ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LOCAL, GLOBAL = "sliding_attention", "full_attention"
"""Hugging Face's layer types."""
DEFAULTS = dict(
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    sliding_window_pattern=6,
    rms_norm_eps=1e-6,
    max_position_embeddings=131_072,
    head_dim=256,
    num_key_value_heads=4,
    tie_word_embeddings=True,
)
"""What `Gemma3TextConfig` assumes where a config.json leaves a setting out."""


class Gemma3Mapping(LlamaMapping):
    model_type = "gemma3_text"

    def links(self, m: ModelConfig) -> list[Link]:
        found = [
            Link("tok_embeddings.weight", "model.embed_tokens.weight"),
            Link("final_norm.weight", "model.norm.weight"),
        ]
        if not m.tie_embeddings:  # a tied head is the embedding (`to_hf` writes it twice)
            found.append(Link("lm_head.weight", "lm_head.weight"))
        for i in range(m.n_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            for mine, hf in [
                ("attn_norm", "input_layernorm"),
                ("attn.wq", "self_attn.q_proj"),
                ("attn.wk", "self_attn.k_proj"),
                ("attn.wv", "self_attn.v_proj"),
                ("attn.wo", "self_attn.o_proj"),
                ("attn.q_norm", "self_attn.q_norm"),
                ("attn.k_norm", "self_attn.k_norm"),
                ("post_attn_norm", "post_attention_layernorm"),
                ("mlp_norm", "pre_feedforward_layernorm"),
                ("mlp.gate", "mlp.gate_proj"),
                ("mlp.up", "mlp.up_proj"),
                ("mlp.down", "mlp.down_proj"),
                ("post_mlp_norm", "post_feedforward_layernorm"),
            ]:
                found.append(Link(f"{ours}{mine}.weight", f"{theirs}{hf}.weight"))
        return found

    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        from transformers import Gemma3TextConfig

        types = [GLOBAL if m.window_of(i) is None else LOCAL for i in range(m.n_layers)]
        # transformers 4 before 4.53 reads only the pattern: every layer but each n-th local
        if m.sliding_window is None:
            pattern = 1
        else:
            pattern = m.sliding_window_pattern or m.n_layers + 1
        scale = m.head_dim if m.query_scale is None else m.query_scale
        factor = m.rope_linear_factor
        return Gemma3TextConfig(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden,
            intermediate_size=m.ffn_hidden,
            num_hidden_layers=m.n_layers,
            num_attention_heads=m.n_heads,
            num_key_value_heads=m.n_kv_heads,
            head_dim=m.head_dim,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=m.max_positions,
            rms_norm_eps=m.norm_eps,
            tie_word_embeddings=m.tie_embeddings,
            attention_bias=False,
            attention_dropout=m.dropout,
            query_pre_attn_scalar=int(scale) if float(scale).is_integer() else scale,
            sliding_window=m.sliding_window,
            layer_types=types,
            sliding_window_pattern=pattern,
            # both transformers read these; 5 files them under rope_parameters by layer type
            rope_theta=m.rope_theta,
            rope_local_base_freq=m.rope_theta if m.rope_local_theta is None else m.rope_local_theta,
            rope_scaling=None if factor is None else {"rope_type": "linear", "factor": factor},
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        raw = DEFAULTS | raw  # a null stays null: sliding_window, the softcaps
        refuse_unsupported(raw)
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        window, pattern = window_settings(raw)
        return {
            "hidden": hidden,
            "n_layers": raw["num_hidden_layers"],
            "n_heads": heads,
            "n_kv_heads": raw["num_key_value_heads"],
            "head_dim": raw["head_dim"] or hidden // heads,
            "ffn_hidden": raw["intermediate_size"],
            "vocab_size": raw["vocab_size"],
            "norm_eps": raw["rms_norm_eps"],
            "max_positions": raw["max_position_embeddings"],
            "tie_embeddings": bool(raw["tie_word_embeddings"]),
            "sliding_window": window,
            "sliding_window_pattern": pattern,
            "query_scale": float(raw["query_pre_attn_scalar"]),
            **rope_settings(raw),
        }


def refuse_unsupported(raw: dict[str, Any]) -> None:
    """ValueError for what a Gemma 3 config.json may say that megalite does not implement."""
    activation = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"activation {activation!r} is not one megalite implements for Gemma 3 (its MLP is "
            "GeGLU with gelu_pytorch_tanh)"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ValueError(
                f"{key}={raw[key]}: megalite does not implement softcapping (Gemma 3 has none; "
                "Gemma 2 does): set it to null"
            )
    if raw.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    if raw.get("attention_bias"):
        raise ValueError("Gemma 3 with attention biases is not supported")


def window_settings(raw: dict[str, Any]) -> tuple[int | None, int | None]:
    """(`model.sliding_window`, `model.sliding_window_pattern`) of the layer types a config.json
    states (`layer_types`, or transformers 4's `sliding_window_pattern`); ValueError where no
    pattern makes them (megalite's layer i is global when (i + 1) % pattern == 0)."""
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        every = raw["sliding_window_pattern"]
        types = [LOCAL if (i + 1) % every else GLOBAL for i in range(n)]
    if len(types) != n or set(types) - {LOCAL, GLOBAL}:
        raise ValueError(f"layer_types {types} are not {n} of {LOCAL!r} and {GLOBAL!r}")
    if LOCAL not in types:
        return None, None
    window = raw["sliding_window"]
    if window is None:
        raise ValueError(f"layer_types has {LOCAL!r} layers, but sliding_window is null")
    if GLOBAL not in types:
        return window, None
    pattern = types.index(GLOBAL) + 1
    if types != [LOCAL if (i + 1) % pattern else GLOBAL for i in range(n)]:
        raise ValueError(
            f"layer_types {types} do not repeat {pattern - 1} local layers and one global, the "
            "layer pattern megalite builds (model.sliding_window_pattern)"
        )
    return window, pattern


def rope_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """`model.rope_theta`, `rope_local_theta` and `rope_linear_factor` of a config.json, from
    transformers 5's `rope_parameters` by layer type or 4's `rope_theta`,
    `rope_local_base_freq` and `rope_scaling` (the global layers'); ValueError for a scaling
    megalite does not implement."""
    by_type = raw.get("rope_parameters") or {}
    if GLOBAL in by_type or LOCAL in by_type:  # transformers 5
        full, local = by_type.get(GLOBAL) or {}, by_type.get(LOCAL) or {}
        theta = full.get("rope_theta", DEFAULTS["rope_theta"])
        local_theta = local.get("rope_theta", DEFAULTS["rope_local_base_freq"])
    else:  # transformers 4
        full, local = raw.get("rope_scaling") or {}, {}
        theta, local_theta = raw["rope_theta"], raw["rope_local_base_freq"]
    factor = None
    for layers, rope in (("global", full), ("local", local)):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("a partial rotary embedding (partial_rotary_factor) is not supported")
        if kind == "default":
            continue
        if kind != "linear" or layers == "local":
            raise ValueError(
                f"rope scaling {kind!r} on the {layers} layers is not supported: megalite "
                "implements Gemma 3's linear scaling of the global layers"
            )
        factor = float(rope["factor"])
    return {
        "rope_theta": float(theta),
        "rope_local_theta": float(local_theta),
        "rope_linear_factor": factor,
        "rope_scaling": "none",
        **dict.fromkeys(ROPE_SCALING_KEYS),
    }


MAPPING = Gemma3Mapping()
