"""Qwen3 as Hugging Face's `Qwen3ForCausalLM`: Llama's name table plus each layer's
`self_attn.q_norm` / `k_norm`, a `head_dim` of its own, and `tie_word_embeddings` both ways
(a tied checkpoint stores only the embedding). Sliding-window attention
(`use_sliding_window`) and attention biases are refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megalite.models.hugging_face import Link
from megalite.models.llama.hf import LlamaMapping, head_dim_of, hf_settings
from megalite.models.qwen2.hf import qwen_settings

from megalite.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3Mapping(LlamaMapping):
    model_type = "qwen3"

    def links(self, m: ModelConfig) -> list[Link]:
        found = super().links(m)
        for i in range(m.n_layers):
            for norm in ("q_norm", "k_norm"):
                ours, theirs = f"layers.{i}.attn.{norm}", f"model.layers.{i}.self_attn.{norm}"
                found.append(Link(f"{ours}.weight", f"{theirs}.weight"))
        return found

    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        from transformers import Qwen3Config

        return Qwen3Config(**hf_settings(m), attention_bias=False, use_sliding_window=False)

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        if raw.get("attention_bias"):
            raise ValueError("Qwen3 with attention biases is not supported")
        return qwen_settings(raw, "Qwen3") | {"head_dim": head_dim_of(raw)}


MAPPING = Qwen3Mapping()
