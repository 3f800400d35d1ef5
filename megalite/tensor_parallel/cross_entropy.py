"""Cross-entropy over vocabulary-parallel logits, never materialising the full logits on a rank.

Each rank holds logits for its piece of the (padded) vocabulary. The softmax needs the global
max and the global sum of exponentials, and the loss needs the target's logit, which lives on
exactly one rank: three all-reduces of (batch, seq) tensors. Padded vocabulary columns are
masked to -inf so the loss equals the unpadded tp = 1 loss (a known Megatron-LM pitfall).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megalite import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size):
        ctx.logits_dtype = logits.dtype
        logits = logits.float()  # (b, s, V/tp): fp32 softmax whatever the activation dtype
        local_vocab = logits.shape[-1]
        real_columns = max(0, min(local_vocab, vocab_size - vocab_start))
        if real_columns < local_vocab:
            logits = logits.clone()
            logits[..., real_columns:] = float("-inf")

        logits_max = logits.amax(dim=-1)
        comm.all_reduce_max(logits_max, group)
        logits = logits - logits_max.unsqueeze(-1)

        local_targets = targets - vocab_start
        outside = (local_targets < 0) | (local_targets >= local_vocab)
        local_targets = local_targets.masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group)

        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit  # (b, s)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_targets, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_targets, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target), in place
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_targets.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: Any, vocab_start: int, vocab_size: int
) -> torch.Tensor:
    """Per-token loss (b, s) from this rank's logits (b, s, V_pad/tp) starting at `vocab_start`.

    `vocab_size` is the real vocabulary: columns at or past it are padding and never predicted.
    With the whole, unpadded vocabulary on one rank this is PyTorch's fused cross-entropy.
    """
    if comm.size(group) == 1 and logits.shape[-1] == vocab_size:
        flat = logits.float().flatten(0, 1)
        return F.cross_entropy(flat, targets.flatten(), reduction="none").view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, vocab_size)
