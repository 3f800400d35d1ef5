"""Llama (Touvron et al. 2023): RMSNorm, rotary position embeddings (Hugging Face rotate_half
layout), SwiGLU MLP, grouped-query attention, no biases, an untied LM head.

Built from the same tensor-parallel pieces as GPT (`models/layers.py`) and read the same way, top to
bottom: the MLP, the block, the model and its forward pass. Under sequence parallelism (SP) the
residual stream between blocks is a sequence shard (b, s/tp, h) instead of (b, s, h).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megalite.kernels import swiglu
from megalite.models.causal_lm import CausalLM
from megalite.models.layers import (
    Attention,
    BuildContext,
    ResidualDropout,
    RMSNorm,
)
from torch import nn

from megalite.context_parallel.layout import SequenceLayout
from megalite.tensor_parallel import (
    ColumnOutput,
    FusedColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
    normal_init,
)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up one fused column-parallel linear (each
    rank its ffn_hidden/tp columns of each), down row-parallel (partial sums combined over tp)."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        cfg, ps, sp = ctx.cfg, ctx.ps, ctx.sequence_parallel
        init, pair = normal_init(cfg.init_std), ctx.linear_pair()
        gate_up = [ColumnOutput("gate", cfg.ffn_hidden), ColumnOutput("up", cfg.ffn_hidden)]
        linear = dict(bias=False, sequence_parallel=sp, pair=pair, float8=ctx.float8)
        self.gate_up = FusedColumnParallelLinear(cfg.hidden, gate_up, ps, init=init, **linear)
        self.down = RowParallelLinear(
            cfg.ffn_hidden, cfg.hidden, ps, init=ctx.out_proj_init, **linear
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # one gather, one GEMM: (b, s, ffn/tp) each
        x = swiglu(gate, up)  # one fused kernel
        return self.down(x)  # (b, s, h), or (b, s/tp, h) under SP


class Block(nn.Module):
    """Pre-norm residual block: x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)). `mlp`: the
    feed-forward's class (Mixtral's is a mixture of experts); `qk_norm`: attention norms each
    head of q and k (Qwen3); `qkv_bias`: q, k and v have biases (Qwen2); `window`: its
    attention's sliding window (Mistral)."""

    def __init__(
        self,
        ctx: BuildContext,
        mlp: type[nn.Module] = MLP,
        qk_norm: bool = False,
        qkv_bias: bool = False,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(ctx.cfg.hidden, ctx)
        self.attn = Attention(
            ctx, bias=False, rotary=True, qk_norm=qk_norm, qkv_bias=qkv_bias, window=window
        )
        self.mlp_norm = RMSNorm(ctx.cfg.hidden, ctx)
        self.mlp = mlp(ctx)
        self.drop = ResidualDropout(ctx)

    def forward(self, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        # the MLP's norm takes the attention's residual add with it (one fused pass): h is the
        # new residual stream x + attn(...), normed is rmsnorm(h)
        h, normed = self.mlp_norm(x, residual=self.drop(self.attn(self.attn_norm(x), layout)))
        return h + self.drop(self.mlp(normed))  # (b, s, h), or (b, s/tp, h) under SP


class Llama(CausalLM):
    """One pipeline chunk of Llama (the whole model when pp = 1): `tok_embeddings` on the first
    chunk, blocks `layers.<global index>`, `final_norm` + `lm_head` on the last (the
    embedding's weight under `model.tie_embeddings`)."""

    block: Callable[..., nn.Module] = Block
    """Builds one block from the context and its layer's `window` (Mixtral's: this block with a
    mixture of experts)."""
    unit_offset_norm = False
    """Whether the final norm scales by 1 + weight (Gemma 3's)."""

    def scale_embedding(self, x: torch.Tensor) -> torch.Tensor:
        """The token embedding's output as the blocks get it: itself (Gemma 3 scales it)."""
        return x

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
            self.tok_embeddings.weight.meta.pp_tied = cfg.tie_embeddings and not has_head
            self.drop = ResidualDropout(ctx)
        # Keyed by global index, so parameter names never depend on the pipeline layout.
        self.layers = nn.ModuleDict(
            {str(i): self.block(ctx, window=cfg.window_of(i)) for i in layer_ids}
        )
        if has_head:
            self.final_norm = RMSNorm(cfg.hidden, ctx, unit_offset=self.unit_offset_norm)
            tied = {}
            if cfg.tie_embeddings:  # on a later pipeline stage a copy kept equal (ParamMeta)
                tied = (
                    dict(tied=self.tok_embeddings)
                    if has_embedding
                    else dict(tied_name="tok_embeddings.weight")
                )
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
            x = self.tok_embeddings(inputs)  # (b, s, h), or (b, s/tp, h) under SP
            x = self.drop(self.scale_embedding(x))
        else:
            x = inputs  # from the previous pipeline stage
        x = self.run_layers(x, layout)  # the blocks; positions enter through rotary q and k
        if not self.has_head:
            return x
        return self.lm_head(self.final_norm(x), targets)
