"""Mixtral's parameters, FLOPs and saved activations in closed form (see `models.formulas`).

FLOPs count the active parameters (Mixtral 8x7B: about 13B of its 47B): per token the router
and the top-k (and shared) experts take part in a matmul, the other experts do not.
"""

from __future__ import annotations

from megalite.models.formulas import (
    RMS_NORM,
    Param,
    Shapes,
    attention_matmul_weights,
    attention_parameters,
    linear_parameters,
    pre_norm_block_saved,
    rotary_buffers,
)
from megalite.models.llama.formulas import LlamaFormulas
from megalite.models.mixtral.moe import active_experts

from megalite.config import Config, ModelConfig


class MixtralFormulas(LlamaFormulas):
    def layer_parameters(self, cfg: Config, layer: int) -> list[Param]:
        m = cfg.model
        h, f, n = m.hidden, m.ffn_hidden // cfg.parallel.tp, m.moe_experts
        pre = f"layers.{layer}."
        params = [
            *RMS_NORM.parameters(pre + "attn_norm", h),
            *attention_parameters(cfg, pre + "attn", bias=False),
            *RMS_NORM.parameters(pre + "mlp_norm", h),
            *linear_parameters(pre + "moe.router", n, h, bias=False),
            *linear_parameters(pre + "moe.gate_up", n * 2 * f, h, bias=False),
            *linear_parameters(pre + "moe.down", n * h, f, bias=False),
        ]
        if m.moe_shared_experts:
            fs = m.moe_shared_experts * f
            params += linear_parameters(pre + "moe.shared_gate_up", 2 * fs, h, bias=False)
            params += linear_parameters(pre + "moe.shared_down", h, fs, bias=False)
        return params

    def layer_buffers(self, m: ModelConfig) -> list[int]:
        return [*rotary_buffers(m), m.moe_experts]  # and the router's bias

    def layer_matmul_weights(self, m: ModelConfig) -> int:
        experts = active_experts(m) * 3 * m.hidden * m.ffn_hidden
        return attention_matmul_weights(m) + m.moe_experts * m.hidden + experts

    def layer_saved(self, x: Shapes) -> list[int]:
        """The MoE keeps, per routed (token, choice) row, its gathered input, gate, up and
        their product (and silu(gate) with PyTorch's SwiGLU), its down output for the gate
        product, and the router's fp32 logits and probabilities."""
        m, p = x.cfg.model, x.cfg.parallel
        rows = x.tokens * m.moe_top_k
        f = m.ffn_hidden // p.tp
        swiglu = 3 if x.device == "cuda" else 4
        router = 2 * x.stream_tokens * m.moe_experts * 4
        mlp = [rows * m.hidden * x.element, *[rows * f * x.element] * swiglu]
        mlp += [rows * m.hidden * x.element, router]
        return pre_norm_block_saved(x, RMS_NORM, mlp, rotary=True)


FORMULAS = MixtralFormulas()
