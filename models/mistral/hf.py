"""Mistral as Hugging Face's `MistralForCausalLM`: Llama's name table, `sliding_window` and
`head_dim` both ways."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megalite.models.llama.hf import LlamaMapping, head_dim_of, hf_settings, llama_shape

from megalite.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MistralMapping(LlamaMapping):
    model_type = "mistral"

    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        from transformers import MistralConfig

        if m.sliding_window_pattern is not None:
            raise ValueError(
                "MistralForCausalLM windows every layer: model.sliding_window_pattern has no "
                "Hugging Face Mistral equivalent"
            )
        return MistralConfig(**hf_settings(m), sliding_window=m.sliding_window)

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {raw.get('hidden_act')!r} is not one megalite implements")
        shape = llama_shape(raw, default_positions=4096 * 32)  # MistralConfig's default
        return shape | {"head_dim": head_dim_of(raw), "sliding_window": raw.get("sliding_window")}


MAPPING = MistralMapping()
