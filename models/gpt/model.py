"""GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm blocks, tanh-GELU MLP, biases
everywhere, and an LM head tied to the token embedding.

It reads like nanoGPT, top to bottom: the MLP, the block, the model and its forward pass. The
layers it is built from are tensor-parallel (see `models/layers.py` for attention and the norms), so
the same file runs at any tp; under sequence parallelism (SP) the residual stream between
blocks is a sequence shard (b, s/tp, h) instead of (b, s, h).
"""

from __future__ import annotations

import torch
from megalite.kernels import bias_gelu
from megalite.models.causal_lm import CausalLM
from megalite.models.layers import (
    Attention,
    BuildContext,
    LayerNorm,
    ResidualDropout,
)
from torch import nn

from megalite.context_parallel.layout import SequenceLayout
from megalite.tensor_parallel import (
    ColumnParallelLinear,
    ParamMeta,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
    make_param,
    normal_init,
)


class MLP(nn.Module):
    """h -> ffn_hidden -> h: column-parallel up (each rank its ffn_hidden/tp columns), fused
    bias + tanh-GELU, row-parallel down (partial sums combined over tp)."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        cfg, sp = ctx.cfg, ctx.sequence_parallel
        init, pair = normal_init(cfg.init_std), ctx.linear_pair()
        linear = dict(bias=True, sequence_parallel=sp, pair=pair, float8=ctx.float8)
        self.fc = ColumnParallelLinear(cfg.hidden, cfg.ffn_hidden, ctx.ps, init=init, **linear)
        self.proj = RowParallelLinear(
            cfg.ffn_hidden, cfg.hidden, ctx.ps, init=ctx.out_proj_init, **linear
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x, add_bias=False)  # (b, s, ffn/tp): the full sequence, gathered under SP
        x = bias_gelu(x, self.fc.bias)  # one fused kernel for bias + GELU
        return self.proj(x)  # (b, s, h), or (b, s/tp, h) under SP


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.attn_norm = LayerNorm(ctx.cfg.hidden, ctx)
        self.attn = Attention(ctx, bias=True, rotary=False)
        self.mlp_norm = LayerNorm(ctx.cfg.hidden, ctx)
        self.mlp = MLP(ctx)
        self.drop = ResidualDropout(ctx)

    def forward(self, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        # the MLP's norm takes the attention's residual add with it (one fused pass): h is the
        # new residual stream x + attn(...), normed is ln(h)
        h, normed = self.mlp_norm(x, residual=self.drop(self.attn(self.attn_norm(x), layout)))
        return h + self.drop(self.mlp(normed))  # (b, s, h), or (b, s/tp, h) under SP


class GPT(CausalLM):
    """One pipeline chunk of GPT-2 (the whole model when pp = 1): `wte` + `wpe` on the first
    chunk, blocks `layers.<global index>`, `final_norm` + `lm_head` on the last."""

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
            self.drop = ResidualDropout(ctx)
        # Keyed by global index, so parameter names never depend on the pipeline layout.
        self.layers = nn.ModuleDict({str(i): Block(ctx) for i in layer_ids})
        if has_head:
            self.final_norm = LayerNorm(cfg.hidden, ctx)
            # Tied to wte; on a later pipeline stage, a copy kept equal to it (see ParamMeta).
            tied = dict(tied=self.wte) if has_embedding else dict(tied_name="wte.weight")
            self.lm_head = VocabParallelOutput(cfg.vocab_size, cfg.hidden, ps, **vocab, **tied)

    def forward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        layout: SequenceLayout | None = None,
    ) -> torch.Tensor:
        """inputs: token ids (b, s) on the first chunk, else the previous chunk's hidden states;
        `layout`: which pieces of the windows they are (context parallelism) and their documents
        (None: whole windows, one document each).
        Returns hidden states, or on the last chunk the summed token loss (an fp32 scalar) given
        targets, or the full logits (b, s, vocab) without."""
        if self.has_embedding:
            x = self.wte(inputs)  # (b, s, h), or (b, s/tp, h) under SP
            x = x + self.wpe[self.sequence_positions(inputs.shape, layout)]
            x = self.drop(x)
        else:
            x = inputs  # from the previous pipeline stage
        x = self.run_layers(x, layout)  # the blocks
        if not self.has_head:
            return x
        return self.lm_head(self.final_norm(x), targets)
