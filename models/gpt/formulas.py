"""GPT's parameters, FLOPs and saved activations in closed form (see `models.formulas`)."""

from __future__ import annotations

from megalite.models.formulas import (
    INDEX_BYTES,
    LAYER_NORM,
    Formulas,
    Param,
    Shapes,
    attention_matmul_weights,
    attention_parameters,
    linear_parameters,
    pre_norm_block_saved,
)

from megalite.config import Config, ModelConfig


class GPTFormulas(Formulas):
    norm = LAYER_NORM
    tied_embeddings = True
    mlp_up_widths = 1

    def embedding_parameters(self, cfg: Config, rows: int, has_head: bool) -> list[Param]:
        """wpe is the chunk's own parameter, so it comes before the submodules' (wte)."""
        h = cfg.model.hidden
        wte = Param("wte.weight", rows * h, own_bucket=not has_head, arrives_last=True)
        return [Param("wpe", cfg.model.max_positions * h), wte]

    def layer_parameters(self, cfg: Config, layer: int) -> list[Param]:
        h, f = cfg.model.hidden, cfg.model.ffn_hidden // cfg.parallel.tp
        pre = f"layers.{layer}."
        return [
            *LAYER_NORM.parameters(pre + "attn_norm", h),
            *attention_parameters(cfg, pre + "attn", bias=True),
            *LAYER_NORM.parameters(pre + "mlp_norm", h),
            *linear_parameters(pre + "mlp.fc", f, h, bias=True),
            *linear_parameters(pre + "mlp.proj", h, f, bias=True),
        ]

    def layer_matmul_weights(self, m: ModelConfig) -> int:
        return attention_matmul_weights(m) + 2 * m.hidden * m.ffn_hidden

    def layer_saved(self, x: Shapes) -> list[int]:
        """The MLP keeps the pre-GELU and post-GELU tensors besides its input."""
        mlp = [x.ffn_activation, *x.mlp_down_input()]
        return pre_norm_block_saved(x, LAYER_NORM, mlp, mlp_up_features=x.cfg.model.ffn_hidden)

    def embedding_saved(self, x: Shapes) -> list[int]:
        """Also the positions: a slice (the rank's shard under SP) of one arange, or of this
        rank's chunks of it under cp; with document masks restarting positions
        (`data.reset_positions`), a row per window."""
        d = x.cfg.data
        rows = x.cfg.train.micro_batch_size if d.document_mask and d.reset_positions else 1
        return super().embedding_saved(x) + [rows * x.seq * INDEX_BYTES]


FORMULAS = GPTFormulas()
