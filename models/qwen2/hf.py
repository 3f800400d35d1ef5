"""Qwen2 as Hugging Face's `Qwen2ForCausalLM`: Llama's name table plus the q, k and v biases,
and `tie_word_embeddings` both ways. Sliding-window attention (`use_sliding_window`) is
refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megalite.models.hugging_face import Link
from megalite.models.llama.hf import LlamaMapping, hf_settings

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
        if raw.get("use_sliding_window"):
            raise ValueError("Qwen2 with sliding-window attention is not supported")
        plain = {k: v for k, v in raw.items() if k != "tie_word_embeddings"}
        return super().config_from_hf(plain) | {
            "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "max_positions": raw.get("max_position_embeddings", 32768),  # transformers' default
        }


MAPPING = Qwen2Mapping()
