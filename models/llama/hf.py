"""Llama as Hugging Face's `LlamaForCausalLM`: one tensor per projection under the same
layout (and the base of the Llama-shaped families' mappings, a tied head among them:
`model.tie_embeddings`). q and k need no permutation, because megalite's rotary embedding
already uses the Hugging Face `rotate_half` convention. Rope scaling travels both ways as
`rope_type: llama3` (transformers 4's `rope_scaling`, 5's `rope_parameters`); other rope types
are refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from megalite.models.hugging_face import HFMapping, Link

from megalite.config import ROPE_SCALING_KEYS, ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlamaMapping(HFMapping):
    model_type = "llama"
    base_prefix = "model."

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
                ("mlp_norm", "post_attention_layernorm"),
                ("attn.wq", "self_attn.q_proj"),
                ("attn.wk", "self_attn.k_proj"),
                ("attn.wv", "self_attn.v_proj"),
                ("attn.wo", "self_attn.o_proj"),
                ("mlp.gate", "mlp.gate_proj"),
                ("mlp.up", "mlp.up_proj"),
                ("mlp.down", "mlp.down_proj"),
            ]:
                found.append(Link(f"{ours}{mine}.weight", f"{theirs}{hf}.weight"))
        return found

    def to_hf(self, params: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
        state = super().to_hf(params, m)
        if m.tie_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def aliases(self, raw: dict[str, Any]) -> dict[str, str]:
        """A Llama with a tied head (trained untied here) may store only the embedding."""
        return (
            {"lm_head.weight": "model.embed_tokens.weight"}
            if raw.get("tie_word_embeddings")
            else {}
        )

    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        from transformers import LlamaConfig

        return LlamaConfig(**hf_settings(m))

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        require_derived_head_dim(raw)
        if raw.get("hidden_act") != "silu":
            raise ValueError(f"activation {raw.get('hidden_act')!r} is not one megalite implements")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ValueError("Llama with attention or MLP biases is not supported")
        return llama_shape(raw)


def head_dim_of(raw: dict[str, Any]) -> int:
    """The head width a Llama-shaped config.json states (null or absent: hidden / heads)."""
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


def require_derived_head_dim(raw: dict[str, Any]) -> None:
    """ValueError unless the head width is hidden / heads (where `model.head_dim` is not free)."""
    if head_dim_of(raw) != raw["hidden_size"] // raw["num_attention_heads"]:
        raise ValueError(f"head_dim {raw['head_dim']} is not hidden / n_heads")


def llama_shape(raw: dict[str, Any], default_positions: int = 2048) -> dict[str, Any]:
    """The settings every Llama-shaped config.json states the same way (Qwen's too): widths,
    heads, norm epsilon, positions (`default_positions` where the file leaves them out, as
    the family's transformers class does) and rotary settings."""
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return {
        "hidden": hidden,
        "n_layers": raw["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": raw.get("num_key_value_heads", heads),
        "ffn_hidden": raw["intermediate_size"],
        "vocab_size": raw["vocab_size"],
        "norm_eps": raw["rms_norm_eps"],
        "max_positions": raw.get("max_position_embeddings", default_positions),
        **rope_from_hf(raw),
    }


def hf_settings(m: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config settings of a Llama-shaped model (Mixtral's too)."""
    return dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden,
        intermediate_size=m.ffn_hidden,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_positions,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,  # transformers 5 files both under rope_parameters
        rope_scaling=hf_rope_scaling(m),
        attention_dropout=m.dropout,
        tie_word_embeddings=m.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
    )


HF_LLAMA3_KEYS = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
}
"""Megalite's llama3 scaling settings by the key Hugging Face stores each under (besides
`original_max_position_embeddings`, which has a default)."""


def hf_rope_scaling(m: ModelConfig) -> dict[str, Any] | None:
    """The `rope_scaling` of a Hugging Face Llama config (None: plain rotary embeddings), in the
    form both transformers 4 and 5 read."""
    if m.rope_scaling == "none":
        return None
    scaling = {"rope_type": m.rope_scaling}
    scaling |= {theirs: getattr(m, ours) for ours, theirs in HF_LLAMA3_KEYS.items()}
    return scaling | {"original_max_position_embeddings": m.rope_original_max_positions}


def rope_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings of a Hugging Face Llama config.json: transformers 4 writes
    `rope_theta` and `rope_scaling` (null when unscaled; `type` in releases before `rope_type`),
    transformers 5 one `rope_parameters` holding both. ValueError for a scaling megalite does
    not implement."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    found = {
        "rope_theta": float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "rope_scaling": "none",
        **dict.fromkeys(ROPE_SCALING_KEYS),
    }
    if kind == "default":
        return found
    if kind != "llama3":
        raise ValueError(
            f"rope scaling {kind!r} is not supported: megalite implements plain rotary "
            "embeddings and Llama 3.1's llama3 scaling"
        )
    missing = [theirs for theirs in HF_LLAMA3_KEYS.values() if rope.get(theirs) is None]
    if missing:
        raise ValueError(f"llama3 rope scaling without {', '.join(missing)}")
    found["rope_scaling"] = "llama3"
    found |= {ours: float(rope[theirs]) for ours, theirs in HF_LLAMA3_KEYS.items()}
    # transformers' default: the model was pretrained at all of its positions
    original = rope.get("original_max_position_embeddings")
    found["rope_original_max_positions"] = int(
        original if original is not None else raw.get("max_position_embeddings", 2048)
    )
    return found


MAPPING = LlamaMapping()
