"""Llama (Touvron et al. 2023): RMSNorm, rotary position embeddings (Hugging Face rotate_half
layout), SwiGLU MLP, grouped-query attention, no biases, an untied LM head. Built from the same
tensor-parallel pieces as GPT."""

from __future__ import annotations

import torch
from megalite.models.common import (
    Attention,
    BuildContext,
    CausalLM,
    RMSNorm,
    SwiGLUMLP,
    TransformerLayer,
    dropout,
)

from megalite.tensor_parallel import VocabParallelEmbedding, VocabParallelOutput, normal_init


class Llama(CausalLM):
    def __init__(
        self, ctx: BuildContext, layer_ids: range, has_embedding: bool = True, has_head: bool = True
    ) -> None:
        super().__init__(ctx, has_embedding, has_head)
        cfg, ps = ctx.cfg, ctx.ps
        vocab = dict(
            round_to=cfg.vocab_round_to,
            init=normal_init(cfg.init_std),
            sequence_parallel=ctx.sequence_parallel,
        )
        if has_embedding:
            self.tok_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, ps, **vocab)
        self.layers = self.make_layers(layer_ids)
        if has_head:
            self.final_norm = RMSNorm(cfg.hidden, ctx)
            self.lm_head = VocabParallelOutput(cfg.vocab_size, cfg.hidden, ps, **vocab)

    def make_layer(self) -> TransformerLayer:
        ctx = self.ctx
        return TransformerLayer(
            ctx,
            attn_norm=RMSNorm(ctx.cfg.hidden, ctx),
            attn=Attention(ctx, bias=False, rotary=True),
            mlp_norm=RMSNorm(ctx.cfg.hidden, ctx),
            mlp=SwiGLUMLP(ctx),
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)  # (b, s, h), or (b, s/tp, h) under SP
        return dropout(x, self.ctx.cfg.dropout, self.training, self.ctx, self.ctx.sequence_parallel)
