"""Mixtral as Hugging Face's `MixtralForCausalLM`, in the layout of the published checkpoints:
Llama's attention and norms, and per layer `block_sparse_moe.gate` (the router) and one
`experts.<e>.w1` (gate), `w3` (up) and `w2` (down) per expert, which are megalite's per-expert
global tensors one to one. (transformers 5 stacks the experts in memory and converts that layout
when it loads and saves.) Only the softmax router without shared experts exists in Mixtral."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch
from megalite.models.hugging_face import Link
from megalite.models.llama.hf import LlamaMapping, hf_settings

from megalite.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralMapping(LlamaMapping):
    model_type = "mixtral"
    moe_prefix = "block_sparse_moe"
    """Where each layer's router (`gate`) and experts sit in the published checkpoints."""
    expert_names = {"gate": "w1", "up": "w3", "down": "w2"}
    """Each expert's three weights by megalite's name."""

    def links(self, m: ModelConfig) -> list[Link]:
        dense_mlp = ("mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")
        found = [link for link in super().links(m) if not link.ours.endswith(dense_mlp)]
        for i in range(m.n_layers):
            ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.{self.moe_prefix}."
            found.append(Link(f"{ours}router.weight", f"{theirs}gate.weight"))
            for e in range(m.moe_experts):
                for mine, hf in self.expert_names.items():
                    found.append(
                        Link(f"{ours}experts.{e}.{mine}.weight", f"{theirs}experts.{e}.{hf}.weight")
                    )
        return found

    def for_model(
        self, state: dict[str, torch.Tensor], keys: Collection[str], m: ModelConfig
    ) -> dict[str, torch.Tensor]:
        """transformers 5 holds each layer's experts stacked: `mlp.gate` (the router),
        `mlp.experts.gate_up_proj` (experts, 2 * ffn, hidden: the gates' rows, then the ups')
        and `mlp.experts.down_proj` (experts, hidden, ffn)."""
        if "model.layers.0.mlp.experts.gate_up_proj" not in keys:
            return state  # transformers 4: the published layout is the in-memory one
        state = dict(state)
        for i in range(m.n_layers):
            old, new = f"model.layers.{i}.{self.moe_prefix}.", f"model.layers.{i}.mlp."
            w = {
                mine: [state.pop(f"{old}experts.{e}.{hf}.weight") for e in range(m.moe_experts)]
                for mine, hf in self.expert_names.items()
            }
            state[f"{new}gate.weight"] = state.pop(f"{old}gate.weight")
            gate_up = [torch.cat(pair) for pair in zip(w["gate"], w["up"], strict=True)]
            state[f"{new}experts.gate_up_proj"] = torch.stack(gate_up)
            state[f"{new}experts.down_proj"] = torch.stack(w["down"])
        return state

    def require_exportable(self, m: ModelConfig, family: str) -> None:
        """ValueError unless the experts are what Hugging Face's `family` holds."""
        if m.moe_router != "softmax" or m.moe_shared_experts or m.moe_capacity_factor:
            raise ValueError(
                f"Hugging Face's {family} is top-k softmax routing, dropless, without shared "
                "experts: set model.moe_router=softmax, moe_shared_experts=0 and leave "
                "moe_capacity_factor unset to export"
            )

    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        from transformers import MixtralConfig

        self.require_exportable(m, "Mixtral")
        return MixtralConfig(
            **hf_settings(m),
            num_local_experts=m.moe_experts,
            num_experts_per_tok=m.moe_top_k,
            # Hugging Face's balancing loss is top_k times megalite's (`router.balancing_loss`)
            router_aux_loss_coef=m.moe_aux_loss_coef / m.moe_top_k,
        )

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        if raw.get("sliding_window") not in (None, 0) and raw["sliding_window"] < raw.get(
            "max_position_embeddings", 0
        ):
            raise ValueError(
                f"sliding-window attention ({raw['sliding_window']} tokens) is not supported"
            )
        found = super().config_from_hf(raw)
        return found | {
            "moe_experts": raw["num_local_experts"],
            "moe_top_k": raw["num_experts_per_tok"],
            "moe_router": "softmax",
            "moe_shared_experts": 0,
        }  # router_aux_loss_coef is a training setting: megalite's own config sets it


MAPPING = MixtralMapping()
