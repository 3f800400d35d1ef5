"""The LM head's loss: vocab-parallel linear + cross-entropy, fused and chunked over tokens.

Each tp rank holds rows [vocab_start, vocab_start + V/tp) of the (padded) output weight and
computes the logits of its piece of the vocabulary. The softmax over the whole vocabulary needs,
per token, the global max and the global sum of exponentials, and the loss needs the target's
logit, which lives on exactly one rank: two all-reduces of per-token values (Megatron-LM's
vocab-parallel cross-entropy). Padded vocabulary columns take part in the GEMMs (so that every
matrix has an aligned leading dimension: at GPT-2's 50,257 rows cuBLAS falls back to slow
kernels, 3-5x slower on an H100) but their logits are set to -inf before the softmax, so they
add nothing to the loss, and their rows get a zero gradient: the loss equals the unpadded tp = 1
loss (a known Megatron-LM pitfall).

Fused: d(loss sum)/d logits = softmax - one_hot(target) is known as soon as the softmax is, so
the forward turns each chunk's logits into that gradient (`kernels.softmax_cross_entropy`: in
Triton on GPU, in place over the 16-bit logits) and multiplies it straight into the input and
weight gradients; backward only scales them by the incoming gradient. No
(tokens x vocab) tensor outlives its chunk (Liger-Kernel's fused linear cross-entropy): the head
keeps its weight gradient for backward instead of its logits, and skips PyTorch's separate
log-softmax backward and the zero-filled logits gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from megalite import comm
from megalite.kernels.cross_entropy import Columns, softmax_cross_entropy

CHUNK_LOGIT_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}
"""Tokens per chunk are chosen so that a chunk's fp32 logits take about this much memory. On CPU,
glibc serves blocks under 32 MiB from its heap and reuses them chunk after chunk, while larger
ones are fresh mappings whose page faults cost as much as the arithmetic. CUDA's caching
allocator reuses any size, so chunks there are larger (fewer launches), yet far smaller than the
full logits."""
MIN_CHUNK_TOKENS = 256
"""At least this many tokens per chunk, so the GEMMs stay efficient for very large vocabularies."""


def chunk_tokens(padded_local_vocab: int, device: torch.device) -> int:
    """Tokens per chunk. Every chunk runs two all-reduces over the tp group, so this must be
    computed from the padded share of the vocabulary (V_pad / tp, equal on every rank), never
    from a rank's own count of real rows: the last rank holds the padding, and different chunk
    sizes would send different sizes to one collective (gloo aborts, NCCL hangs)."""
    budget = CHUNK_LOGIT_BYTES["cuda" if device.type == "cuda" else "cpu"]
    return max(MIN_CHUNK_TOKENS, budget // (4 * padded_local_vocab))


def _head_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    group: Any,
    vocab_start: int,
    vocab_size: int,
    with_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sum of the token losses, and (with_grads) its gradients for x and weight.

    x: (tokens, h); weight: (V/tp, h) including padded rows; targets: (tokens,).
    """
    real_rows = max(0, min(weight.shape[0], vocab_size - vocab_start))
    local = targets - vocab_start
    local = torch.where((local >= 0) & (local < real_rows), local, -1)  # -1: another rank's

    vocab = Columns(
        real_rows,
        reduce_max=lambda t: comm.all_reduce_max(t, group),
        reduce_sum=lambda t: comm.all_reduce(t, group),
    )

    total = torch.zeros((), dtype=torch.float32, device=x.device)
    if with_grads:
        grad_x = torch.empty_like(x)
        # The weight gradient, summed over chunks in fp32; padded rows stay zero.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    step = chunk_tokens(weight.shape[0], x.device)
    for start in range(0, x.shape[0], step):
        piece = slice(start, start + step)
        x_c = x[piece]
        logits = x_c @ weight.t()  # (chunk, V/tp); the softmax is fp32 whatever the dtype
        loss, grad_logits = softmax_cross_entropy(logits, local[piece], vocab, with_grads)
        total += loss
        if not with_grads:
            continue
        torch.mm(grad_logits, weight, out=grad_x[piece])
        if grad_logits.dtype == grad_weight.dtype:
            grad_weight.addmm_(grad_logits.t(), x_c)
        else:  # a 16-bit GEMM per chunk, summed over chunks in fp32
            grad_weight += grad_logits.t() @ x_c
    if not with_grads:
        return total, None, None
    # Kept until backward in the weight's dtype, except fp16: its range cannot hold a gradient
    # summed over a micro-batch's tokens before the loss weight scales it down.
    kept = torch.float32 if weight.dtype == torch.float16 else weight.dtype
    return total, grad_x, grad_weight.to(kept)


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, group, vocab_start, vocab_size):
        total, grad_x, grad_weight = _head_loss(
            x, weight, targets, group, vocab_start, vocab_size, with_grads=True
        )
        ctx.save_for_backward(grad_x, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_weight = ctx.saved_tensors
        # Autograd casts the fp32-kept fp16 weight gradient back to the weight's dtype.
        return grad_x * grad_total, grad_weight * grad_total, None, None, None, None


def vocab_parallel_head_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    group: Any,
    vocab_start: int,
    vocab_size: int,
) -> torch.Tensor:
    """Sum over tokens of cross-entropy(x @ weight^T, targets), an fp32 scalar.

    x: (b, s, h), the full sequence; weight: this rank's rows (V_pad/tp, h) of the output
    weight, starting at global row `vocab_start`; `vocab_size`: the real vocabulary, rows at or
    past it are padding and never predicted. Returns the sum rather than per-token losses
    because the gradient is computed in the forward, which needs the upstream gradient to be
    one number.
    """
    x2d, targets1d = x.flatten(0, -2), targets.flatten()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _FusedHeadLoss.apply(x2d, weight, targets1d, group, vocab_start, vocab_size)
    total, _, _ = _head_loss(x2d, weight, targets1d, group, vocab_start, vocab_size, False)
    return total
