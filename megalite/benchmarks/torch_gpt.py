"""The PyTorch side of the benchmarks: `TorchGPT`, the plain `nn.Module` twin of megalite's GPT
(learned positions, LayerNorm, tanh-GELU MLP of width 4h, biases, tied embeddings) that the
contenders parallelise with PyTorch's own tools, and AdamW configured as megalite's.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from megalite.config import OptimConfig


class Embedding(nn.Module):
    """Token + learned position embeddings."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.wte(ids) + self.wpe(positions)  # (b, s, h)


class SelfAttention(nn.Module):
    """Causal attention; works on whatever number of heads its (sharded) projections give."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv = (nn.Linear(hidden, hidden) for _ in range(3))
        self.wo = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, local heads, s, hd)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(hidden), SelfAttention(hidden, heads)
        self.ln_2, self.mlp = nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """GPT-2 as megalite builds it, in plain PyTorch. `layers` picks a run of the blocks and
    `embed` / `head` whether this piece has the embedding / final norm + tied LM head (pipeline
    stages); by default it is the whole model. Returns logits (b, s, vocab)."""

    def __init__(
        self,
        args: argparse.Namespace,
        layers: range | None = None,
        embed: bool = True,
        head: bool = True,
    ) -> None:
        super().__init__()
        h, layers = args.hidden, range(args.layers) if layers is None else layers
        self.embed = Embedding(args.vocab, h, args.seq) if embed else None
        self.blocks = nn.ModuleList(Block(h, args.heads) for _ in layers)
        self.ln_f = nn.LayerNorm(h) if head else None
        self.lm_head = nn.Linear(h, args.vocab, bias=False) if head else None
        self.reset_parameters(args, layers)
        if embed and head:
            self.lm_head.weight = self.embed.wte.weight

    def reset_parameters(self, args: argparse.Namespace, layers: range) -> None:
        """GPT-2 init as megalite's: normal(0.02), output projections 0.02/sqrt(2L), zero
        biases, unit norms. Every piece draws from a stream of its own (the embedding, each
        block by its global index), so the weights do not depend on how the model is cut into
        pipeline stages, and the last stage's copy of the tied head equals the embedding."""

        def fill(module: nn.Module, stream: int) -> None:
            generator = torch.Generator().manual_seed(args.seed * 1009 + stream)
            for name, sub in module.named_modules():
                if isinstance(sub, (nn.Linear, nn.Embedding)):
                    scaled = name.endswith(("wo", "proj"))  # they write into the residual
                    std = 0.02 / math.sqrt(2 * args.layers) if scaled else 0.02
                    sub.weight.data.normal_(0.0, std, generator=generator)
                    if getattr(sub, "bias", None) is not None:
                        sub.bias.data.zero_()
                elif isinstance(sub, nn.LayerNorm):
                    sub.reset_parameters()  # ones and zeros

        if self.embed is not None:
            fill(self.embed, 0)
        if self.lm_head is not None:
            fill(self.lm_head, 0)  # wte's stream, drawn first there: the same values
        for block, index in zip(self.blocks, layers):
            fill(block, 1 + index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.ln_f(x))


ADAMW_IMPLEMENTATIONS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
"""`--torch-adamw` choices: torch's own pick, or its foreach / fused kernels."""


def torch_adamw(
    params: Iterable[nn.Parameter], lr: float, implementation: str, sharded: bool = False
) -> torch.optim.Optimizer:
    """torch.optim.AdamW configured as megalite's defaults (`OptimConfig`: weight decay on
    matrices only, betas, eps), so the optimizers do the same work; `sharded` wraps it in
    `ZeroRedundancyOptimizer` (inside a process group)."""
    o = OptimConfig()
    params = list(params)
    # DTensor and plain parameters (tensor parallelism) in separate groups: torch's foreach
    # and fused kernels cannot take a mix of them in one call.
    groups = []
    for matrices in (True, False):
        for dtensor in (True, False):
            chosen = [
                p
                for p in params
                if (p.dim() >= 2) == matrices and isinstance(p, DTensor) == dtensor
            ]
            if chosen:
                groups.append(
                    {"params": chosen, "weight_decay": o.weight_decay if matrices else 0.0}
                )
    impl = ADAMW_IMPLEMENTATIONS[implementation]
    kwargs = dict(lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, **impl)
    if sharded:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of (b, s, vocab) logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
