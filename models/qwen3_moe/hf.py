"""Qwen3-MoE as Hugging Face's `Qwen3MoeForCausalLM`: Qwen3's attention links (`models.qwen3.hf`)
and Mixtral's experts (`models.mixtral.hf`) under Qwen's names, per layer `mlp.gate` (the
router) and `mlp.experts.<e>.gate_proj` / `up_proj` / `down_proj`. Every layer sparse
(`decoder_sparse_step` 1, no `mlp_only_layers`) and the top-k gates renormalised
(`norm_topk_prob`), as every released Qwen3-MoE is; other settings are refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megalite.models.llama.hf import hf_settings
from megalite.models.mixtral.hf import MixtralMapping
from megalite.models.qwen3.hf import Qwen3Mapping

from megalite.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3MoEMapping(Qwen3Mapping, MixtralMapping):
    """Qwen3's links (QK-norms, a tied head) over Mixtral's (experts) over Llama's."""

    model_type = "qwen3_moe"
    moe_prefix = "mlp"
    expert_names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        from transformers import Qwen3MoeConfig

        self.require_exportable(m, "Qwen3-MoE")
        return Qwen3MoeConfig(
            **hf_settings(m),
            moe_intermediate_size=m.ffn_hidden,
            num_experts=m.moe_experts,
            num_experts_per_tok=m.moe_top_k,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            # Hugging Face's balancing loss is top_k times megalite's (`router.balancing_loss`)
            router_aux_loss_coef=m.moe_aux_loss_coef / m.moe_top_k,
            attention_bias=False,
            use_sliding_window=False,
        )

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        if not raw.get("norm_topk_prob"):
            raise ValueError(
                "Qwen3-MoE without norm_topk_prob (gates not renormalised over the top k) is "
                "not supported"
            )
        if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
            raise ValueError("Qwen3-MoE with dense layers among the sparse ones is not supported")
        experts = raw | {"intermediate_size": raw["moe_intermediate_size"]}  # each expert's
        return Qwen3Mapping.config_from_hf(self, experts) | {
            # the published configs say num_experts; transformers 5 writes num_local_experts
            "moe_experts": raw.get("num_experts", raw.get("num_local_experts")),
            "moe_top_k": raw["num_experts_per_tok"],
            "moe_router": "softmax",
            "moe_shared_experts": 0,
        }  # router_aux_loss_coef is a training setting: megalite's own config sets it


MAPPING = Qwen3MoEMapping()
