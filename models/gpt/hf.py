"""GPT as Hugging Face's `GPT2LMHeadModel`: its `Conv1D` layout stores every projection
transposed, with q, k and v fused into one `c_attn`; the head is the token embedding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from megalite.models.hugging_face import HFMapping, Link

from megalite.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GPT2Mapping(HFMapping):
    model_type = "gpt2"
    base_prefix = "transformer."

    def links(self, m: ModelConfig) -> list[Link]:
        found = [
            Link("wte.weight", "transformer.wte.weight"),
            Link("wpe", "transformer.wpe.weight"),
            Link("final_norm.weight", "transformer.ln_f.weight"),
            Link("final_norm.bias", "transformer.ln_f.bias"),
        ]
        for i in range(m.n_layers):
            ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
            for n, w in enumerate(("wq", "wk", "wv")):  # fused into c_attn
                found.append(
                    Link(f"{ours}attn.{w}.weight", f"{theirs}attn.c_attn.weight", True, n, 3)
                )
                found.append(Link(f"{ours}attn.{w}.bias", f"{theirs}attn.c_attn.bias", False, n, 3))
            for mine, hf, conv1d in [
                ("attn_norm", "ln_1", False),
                ("mlp_norm", "ln_2", False),
                ("attn.wo", "attn.c_proj", True),
                ("mlp.fc", "mlp.c_fc", True),
                ("mlp.proj", "mlp.c_proj", True),
            ]:
                found.append(Link(f"{ours}{mine}.weight", f"{theirs}{hf}.weight", conv1d))
                found.append(Link(f"{ours}{mine}.bias", f"{theirs}{hf}.bias"))
        return found

    def to_hf(self, params: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
        state = super().to_hf(params, m)
        state["lm_head.weight"] = state["transformer.wte.weight"]  # tied
        return state

    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=m.vocab_size,
            n_positions=m.max_positions,
            n_embd=m.hidden,
            n_layer=m.n_layers,
            n_head=m.n_heads,
            n_inner=m.ffn_hidden,
            activation_function="gelu_new",  # the tanh approximation, as megalite's GPT
            layer_norm_epsilon=m.norm_eps,
            resid_pdrop=m.dropout,
            embd_pdrop=m.dropout,
            attn_pdrop=m.dropout,
            bos_token_id=None,  # GPT-2's 50256 would lie outside a megalite vocabulary
            eos_token_id=None,
            tie_word_embeddings=True,
        )

    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        if not raw.get("scale_attn_weights", True) or raw.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim)")
        if not raw.get("tie_word_embeddings", True):
            raise ValueError("an LM head of its own (tie_word_embeddings false): GPT's is wte")
        activation = raw.get("activation_function")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"activation {activation!r} is not one megalite implements")
        n_inner = raw.get("n_inner")
        return {
            "hidden": raw["n_embd"],
            "n_layers": raw["n_layer"],
            "n_heads": raw["n_head"],
            "ffn_hidden": 4 * raw["n_embd"] if n_inner is None else n_inner,
            "vocab_size": raw["vocab_size"],
            "norm_eps": raw["layer_norm_epsilon"],
            "max_positions": raw.get("n_positions", 1024),  # transformers' default
        }


MAPPING = GPT2Mapping()
