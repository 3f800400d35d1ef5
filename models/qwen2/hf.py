"""Qwen2 as Hugging Face's `Qwen2ForCausalLM`: Llama's name table plus the q, k and v biases,
and `tie_word_embeddings` both ways. Sliding-window attention (`use_sliding_window`) is
refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megalite.models.hugging_face import Link
from megalite.models.llama.hf import (
    LlamaMapping,
    hf_settings,
    llama_shape,
    require_derived_head_dim,
)

from megalite.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2Mapping(LlamaMapping):
    model_type = "qwen2"

    def links(self, m: ModelConfig) -> list[Link]:
        found = super().links(m)
        for i in range(m.n_layers):
            for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
                found.append(
                    Link(
                        f"layers.{i}.attn.{ours}.bias", f"model.layers.{i}.self_attn.{theirs}.bias"
                    )
                )
        return found

    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        from transformers import Qwen2Config

        return Qwen2Config(**hf_settings(m), use_sliding_window=False)

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        require_derived_head_dim(raw)
        return qwen_settings(raw, "Qwen2")


def qwen_settings(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """The settings of a Qwen config.json (Qwen2's, Qwen3's): Llama's shape, the tied head, and
    transformers' 32768 positions by default; sliding windows and other activations refused."""
    if raw.get("use_sliding_window"):
        raise ValueError(f"{family} with sliding-window attention is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"activation {raw.get('hidden_act')!r} is not one megalite implements")
    tied = bool(raw.get("tie_word_embeddings", False))
    return llama_shape(raw, default_positions=32768) | {"tie_embeddings": tied}


MAPPING = Qwen2Mapping()
