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
)
from megalite.models.llama.formulas import LlamaFormulas
from megalite.models.moe import active_experts

from megalite.config import Config, ModelConfig
from megalite.float8 import takes_float8


class MixtralFormulas(LlamaFormulas):
    def layer_parameters(self, cfg: Config, layer: int) -> list[Param]:
        m = cfg.model
        h, f, n = m.hidden, m.ffn_hidden // cfg.parallel.tp, m.moe_experts
        local = n // cfg.parallel.ep  # this ep rank's experts
        pre = f"layers.{layer}."
        params = [
            *RMS_NORM.parameters(pre + "attn_norm", h),
            *attention_parameters(cfg, pre + "attn", bias=False),
            *self.qk_norm_parameters(cfg, pre + "attn"),
            *RMS_NORM.parameters(pre + "mlp_norm", h),
            *linear_parameters(pre + "mlp.router", n, h, bias=False),
            Param(pre + "mlp.gate_up.weight", local * 2 * f * h, expert=True),
            Param(pre + "mlp.down.weight", local * h * f, expert=True),
        ]
        if m.moe_shared_experts:
            fs = m.moe_shared_experts * f
            params += linear_parameters(pre + "mlp.shared_gate_up", 2 * fs, h, bias=False)
            params += linear_parameters(pre + "mlp.shared_down", h, fs, bias=False)
        return params

    def layer_matmul_weights(self, m: ModelConfig) -> int:
        experts = active_experts(m) * 3 * m.hidden * m.ffn_hidden
        return attention_matmul_weights(m) + m.moe_experts * m.hidden + experts

    def mlp_deferred_inputs(self, x: Shapes) -> list[int]:
        """None: the router, experts (grouped GEMMs) and shared experts are no tensor-parallel
        linears, so a split backward computes their weight gradients in B."""
        return []

    def deferred_matmul_weights(self, m: ModelConfig) -> int:
        return attention_matmul_weights(m)

    def layer_saved(self, x: Shapes) -> list[int]:
        """Besides its input (the block counts it), the MoE keeps per routed (token, choice)
        row: the gathered row, gate and up and their product (and silu(gate) with PyTorch's
        SwiGLU), the expert output the gate multiplies, and two int64 indices (the rows'
        tokens, the way back to token order; with ep two more, the received rows' regrouping);
        per token its gates in the activation dtype; and per token the router saw (this rank's
        sequence shard under SP) its fp32 probabilities, its choices (int64) and the gate
        normalisation (fp32). Routing is assumed balanced (with expert parallelism a rank
        receives as many rows as it sends). Under `train.fp8=tensorwise` each expert GEMM also
        keeps its scales (`_float8_scales`)."""
        m, p = x.cfg.model, x.cfg.parallel
        rows, k, e = x.tokens * m.moe_top_k, m.moe_top_k, x.element
        f = m.ffn_hidden // p.tp
        swiglu = 3 if x.device == "cuda" else 4
        routed = [rows * m.hidden * e, *[rows * f * e] * swiglu, rows * m.hidden * e]
        routed += [2 * rows * 8, x.tokens * k * e]
        if p.ep > 1:  # the received rows' order by local expert, and back
            routed += [2 * rows * 8]
        routed_by = x.stream_tokens  # the router runs on this rank's own tokens
        router = [routed_by * m.moe_experts * 4, routed_by * k * 8, routed_by * (k + 1) * 4]
        shared = []
        if m.moe_shared_experts:  # gate and up (one tensor), their product, silu on the CPU,
            fs = m.moe_shared_experts * f  # and under SP the gathered tokens they read
            shared = [x.tokens * fs * e] * swiglu + ([x.tokens * m.hidden * e] if p.sp else [])
        float8 = _float8_scales(x, rows)
        return pre_norm_block_saved(x, RMS_NORM, routed + router + shared + float8, rotary=True)


def _float8_scales(x: Shapes, rows: int) -> list[int]:
    """The fp32 scales the experts' two tensorwise float8 GEMMs keep (`float8.experts`): the
    weight's, and the input's, one per row where the rows are of several micro-batches (ep)
    or some are only computed to be dropped (a capacity), else one; the shared experts' the
    same, one each. Rowwise casts again in backward and keeps none."""
    m, t = x.cfg.model, x.cfg.train
    if t.fp8 != "tensorwise" or not takes_float8(t.fp8_min_dim, m.hidden, m.ffn_hidden):
        return []
    per_row = x.cfg.parallel.ep > 1 or m.moe_capacity_factor is not None
    experts = [rows * 4 if per_row else 4, 4] * 2
    return experts + ([4] * 4 if m.moe_shared_experts else [])


FORMULAS = MixtralFormulas()
