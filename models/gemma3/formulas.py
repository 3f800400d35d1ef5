"""Gemma 3's parameters, FLOPs and saved activations in closed form (see `models.formulas`):
Llama's linears and QK-norms, four norms a block, each of which keeps the fp32 1 + weight it
multiplies by (`UnitOffsetRMSNormFormulas`); the two after a branch keep that branch's output
as their input, and the GeGLU MLP keeps gate, up and gelu(gate) (plain torch, on every device).
FLOPs are Llama's: a window changes the attention's, which `models.flops` counts per layer."""

from __future__ import annotations

from megalite.models.formulas import (
    Param,
    RMSNormFormulas,
    Shapes,
    attention_parameters,
    attention_projection_copy,
    attention_saved,
    linear_input_saved,
    linear_parameters,
    qkv_features,
    residual_masks,
    rotary_saved,
)
from megalite.models.llama.formulas import LlamaFormulas
from megalite.models.qwen3.formulas import qk_norm_saved

from megalite.config import Config


class UnitOffsetRMSNormFormulas(RMSNormFormulas):
    """`RMSNorm(unit_offset=True)`: RMSNorm's tensors, and the fp32 1 + weight (hidden wide)
    that the norm multiplies by and keeps for its input's gradient."""

    def saved(self, x: Shapes, keeps_input: bool) -> list[int]:
        return super().saved(x, keeps_input) + [x.cfg.model.hidden * 4]


UNIT_OFFSET_RMS_NORM = UnitOffsetRMSNormFormulas()


class Gemma3Formulas(LlamaFormulas):
    norm = UNIT_OFFSET_RMS_NORM
    qk_norm = True

    def layer_parameters(self, cfg: Config, layer: int) -> list[Param]:
        h, f = cfg.model.hidden, cfg.model.ffn_hidden // cfg.parallel.tp
        pre = f"layers.{layer}."
        norm = self.norm.parameters
        return [
            *norm(pre + "attn_norm", h),
            *attention_parameters(cfg, pre + "attn", bias=False),
            *self.qk_norm_parameters(cfg, pre + "attn"),
            *norm(pre + "post_attn_norm", h),
            *norm(pre + "mlp_norm", h),
            *linear_parameters(pre + "mlp.gate_up", 2 * f, h, bias=False),
            *linear_parameters(pre + "mlp.down", h, f, bias=False),
            *norm(pre + "post_mlp_norm", h),
        ]

    def layer_saved(self, x: Shapes) -> list[int]:
        """The block in order, its input aside: the input norm; q, k, v's input, the QK-norms
        (each with its head_dim-wide 1 + weight), rotary and attention; the norm after it,
        keeping attention's output; the MLP's norm with the residual add (keeping the sum);
        the MLP's input, gate, up, gelu(gate) and the down projection's input; the norm after
        it, keeping the MLP's output."""
        m, norm = x.cfg.model, self.norm
        kept = norm.keeps_input(x)
        stream = [x.stream_tokens * m.hidden * x.element]
        return (
            norm.saved(x, keeps_input=False)
            + linear_input_saved(x, qkv_features(m))
            + qk_norm_saved(x)
            + [m.head_dim * 4] * 2
            + rotary_saved(x)
            + attention_saved(x)
            + attention_projection_copy(x)
            + norm.saved(x, keeps_input=kept)
            + residual_masks(x, 1)
            + stream * kept
            + norm.saved(x, keeps_input=False)
            + linear_input_saved(x, 2 * m.ffn_hidden)
            + [x.ffn_activation] * 3
            + x.mlp_down_input()
            + norm.saved(x, keeps_input=kept)
            + residual_masks(x, 1)
        )


FORMULAS = Gemma3Formulas()
