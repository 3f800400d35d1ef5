"""GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm blocks, tanh-GELU MLP, biases
everywhere, and an LM head tied to the token embedding. It reads like nanoGPT; the layers it is
built from are tensor-parallel, so the same file runs at any tp."""

from __future__ import annotations

import torch
from megalite.models.common import (
    Attention,
    BuildContext,
    CausalLM,
    GeluMLP,
    LayerNorm,
    TransformerLayer,
    dropout,
)

from megalite.tensor_parallel import (
    ParamMeta,
    VocabParallelEmbedding,
    VocabParallelOutput,
    make_param,
    normal_init,
)


class GPT(CausalLM):
    def __init__(
        self, ctx: BuildContext, layer_ids: range, has_embedding: bool = True, has_head: bool = True
    ) -> None:
        super().__init__(ctx, has_embedding, has_head)
        cfg, ps, sp = ctx.cfg, ctx.ps, ctx.sequence_parallel
        init = normal_init(cfg.init_std)
        vocab = dict(round_to=cfg.vocab_round_to, init=init, sequence_parallel=sp)
        if has_embedding:
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, ps, **vocab)
            # One row per position the model knows (max_positions; training uses the first
            # seq_len). Replicated over tp; under SP each rank adds the rows of its own positions.
            meta = ParamMeta((cfg.max_positions, cfg.hidden), init, tp_grad_reduce=sp)
            self.wpe = make_param((cfg.max_positions, cfg.hidden), meta, ps)
            self.wte.weight.meta.pp_tied = not has_head  # the head is on the last stage
        self.layers = self.make_layers(layer_ids)
        if has_head:
            self.final_norm = LayerNorm(cfg.hidden, ctx)
            # Tied to wte; on a later pipeline stage, a copy kept equal to it (see ParamMeta).
            tied = dict(tied=self.wte) if has_embedding else dict(tied_name="wte.weight")
            self.lm_head = VocabParallelOutput(cfg.vocab_size, cfg.hidden, ps, **vocab, **tied)

    def make_layer(self) -> TransformerLayer:
        ctx = self.ctx
        return TransformerLayer(
            ctx,
            attn_norm=LayerNorm(ctx.cfg.hidden, ctx),
            attn=Attention(ctx, bias=True, rotary=False),
            mlp_norm=LayerNorm(ctx.cfg.hidden, ctx),
            mlp=GeluMLP(ctx),
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)  # (b, s, h), or (b, s/tp, h) under SP
        x = x + self.wpe[self.sequence_positions(ids.shape[1])]
        return dropout(x, self.ctx.cfg.dropout, self.training, self.ctx, self.ctx.sequence_parallel)
