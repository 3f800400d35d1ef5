"""Llama's parameters, FLOPs and saved activations in closed form (see `models.formulas`)."""

from __future__ import annotations

from megalite.models.formulas import (
    RMS_NORM,
    Formulas,
    Param,
    Shapes,
    attention_matmul_weights,
    attention_parameters,
    linear_parameters,
    pre_norm_block_saved,
    rotary_buffers,
)

from megalite.config import Config, ModelConfig


class LlamaFormulas(Formulas):
    norm = RMS_NORM
    tied_embeddings = False

    def embedding_parameters(self, cfg: Config, rows: int, has_head: bool) -> list[Param]:
        """A tied embedding (`model.tie_embeddings`) away from the head has a bucket of its
        own, as GPT's."""
        own = cfg.model.tie_embeddings and not has_head
        return [Param("tok_embeddings.weight", rows * cfg.model.hidden, own_bucket=own)]

    qk_norm = False
    """Whether attention norms each head of q and k (Qwen3): a head_dim weight each."""
    qkv_bias = False
    """Whether q, k and v have biases (Qwen2)."""

    def layer_parameters(self, cfg: Config, layer: int) -> list[Param]:
        h, f = cfg.model.hidden, cfg.model.ffn_hidden // cfg.parallel.tp
        pre = f"layers.{layer}."
        return [
            *RMS_NORM.parameters(pre + "attn_norm", h),
            *attention_parameters(cfg, pre + "attn", bias=False, qkv_bias=self.qkv_bias),
            *self.qk_norm_parameters(cfg, pre + "attn"),
            *RMS_NORM.parameters(pre + "mlp_norm", h),
            *linear_parameters(pre + "mlp.gate_up", 2 * f, h, bias=False),
            *linear_parameters(pre + "mlp.down", h, f, bias=False),
        ]

    def qk_norm_parameters(self, cfg: Config, attention: str) -> list[Param]:
        """The QK-norms' weights where the architecture has them (registered after the
        attention's linears)."""
        if not self.qk_norm:
            return []
        head_dim = cfg.model.head_dim
        return [
            p
            for n in ("q_norm", "k_norm")
            for p in RMS_NORM.parameters(f"{attention}.{n}", head_dim)
        ]

    def layer_buffers(self, m: ModelConfig) -> list[int]:
        return rotary_buffers(m)

    def layer_matmul_weights(self, m: ModelConfig) -> int:
        return attention_matmul_weights(m) + 3 * m.hidden * m.ffn_hidden

    def layer_saved(self, x: Shapes) -> list[int]:
        """The MLP keeps gate, up and their product besides its input (Triton's SwiGLU), and
        silu(gate) too with PyTorch's reference; attention rotates q and k."""
        mlp = [x.ffn_activation] * (2 if x.device == "cuda" else 3) + x.mlp_down_input()
        up = 2 * x.cfg.model.ffn_hidden
        return pre_norm_block_saved(x, RMS_NORM, mlp, rotary=True, mlp_up_features=up)


FORMULAS = LlamaFormulas()
