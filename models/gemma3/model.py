"""Gemma 3 (its text model): Llama's pieces, rearranged. Read it beside models/llama/model.py.

- Every RMSNorm scales by 1 + weight, the weight initialised to 0 (`RMSNorm(unit_offset=True)`),
  QK-norm's too.
- Sandwich norms: each branch is normed on its way in and on its way out, x + norm(attn(norm(x))),
  then h + norm(mlp(norm(h))).
- The MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x)).
- The token embedding is scaled by sqrt(hidden), rounded to the activations' dtype first as
  Hugging Face's model does, and the head is the embedding (`model.tie_embeddings`).
- Local layers attend within a sliding window with rotary base `model.rope_local_theta`;
  every `model.sliding_window_pattern`-th layer is global, with `model.rope_theta` (linearly
  scaled by `model.rope_linear_factor`); the scores are scaled by `model.query_scale ** -0.5`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megalite.models.layers import (
    Attention,
    BuildContext,
    LinearScaling,
    ResidualDropout,
    RMSNorm,
)
from megalite.models.llama.model import MLP as SwiGLU
from megalite.models.llama.model import Llama
from torch import nn

from megalite.context_parallel.layout import SequenceLayout


class MLP(SwiGLU):
    """GeGLU: Llama's gate/up and down linears around gelu_tanh(gate) * up (plain torch ops:
    no fused kernel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # one gather, one GEMM: (b, s, ffn/tp) each
        return self.down(F.gelu(gate, approximate="tanh") * up)  # (b, s, h), or shards under SP


class Block(nn.Module):
    """Sandwich-norm block: h = x + post_attn_norm(attn(attn_norm(x))), then
    h + post_mlp_norm(mlp(mlp_norm(h))). With a `window` it is a local layer (the local rotary
    base), else a global one (every key, the global base and its scaling)."""

    def __init__(self, ctx: BuildContext, window: int | None) -> None:
        super().__init__()
        cfg = ctx.cfg
        norm = functools.partial(RMSNorm, cfg.hidden, ctx, unit_offset=True)
        if window is not None:  # local
            theta = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
            scaling = None
        else:
            theta = cfg.rope_theta
            factor = cfg.rope_linear_factor
            scaling = None if factor is None else LinearScaling(factor)
        self.attn_norm = norm()
        self.attn = Attention(
            ctx,
            bias=False,
            rotary=True,
            qk_norm=True,
            unit_offset=True,
            window=window,
            softmax_scale=None if cfg.query_scale is None else cfg.query_scale**-0.5,
            rope_theta=theta,
            rope_scaling=scaling,
        )
        self.post_attn_norm = norm()
        self.mlp_norm = norm()
        self.mlp = MLP(ctx)
        self.post_mlp_norm = norm()
        self.drop = ResidualDropout(ctx)

    def forward(self, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        branch = self.post_attn_norm(self.attn(self.attn_norm(x), layout))
        # the MLP's norm takes the attention's residual add with it: h = x + branch
        h, normed = self.mlp_norm(x, residual=self.drop(branch))
        return h + self.drop(self.post_mlp_norm(self.mlp(normed)))  # (b, s, h), or shards


@functools.cache
def embedding_scale(hidden: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) as Hugging Face multiplies by it: an fp32 tensor cast to the activations'
    dtype (bf16 rounds sqrt(3072) = 55.43 to 55.5)."""
    return torch.tensor(hidden**0.5, dtype=torch.float32).to(dtype).item()


class Gemma3(Llama):
    """One pipeline chunk of Gemma 3: Llama's, with Gemma's blocks, a final norm that scales by
    1 + weight and the embedding scaled by sqrt(hidden) (tied to the head, as Gemma 3 always
    is: `model.tie_embeddings`)."""

    block = Block
    unit_offset_norm = True

    def scale_embedding(self, x: torch.Tensor) -> torch.Tensor:
        return x * embedding_scale(self.ctx.cfg.hidden, x.dtype)
