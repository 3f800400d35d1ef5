"""The routing math of mixture-of-experts layers: which k of the E experts each token goes to,
the weight (gate) of each choice in the combined output, and what keeps the experts evenly
loaded.

Two routers. Mixtral's softmax top-k: the gates are the chosen probabilities renormalised.
DeepSeek-V3's sigmoid top-k: a per-expert bias moves the choice but not the gates, and after each
step the bias is nudged towards balance (`update_bias`, auxiliary-loss-free balancing).

The Switch Transformer balancing loss and ST-MoE's z-loss are sums over tokens divided by the
token count of the whole set they are defined over. Each shard of the tokens (a micro-batch, a
dp or cp rank) computes its part, and the parts add up to the loss of the set.

Capacity (GShard) bounds the (token, choice) pairs an expert takes; pairs past it are dropped,
every token's first choice served before any second choice.

Logits are routed in fp32 (fp64 stays fp64, for gradcheck): bf16 probabilities tie and round
too coarsely to choose experts by. Nothing here reads a device value back to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and their weights, and the probabilities they came from."""

    experts: torch.Tensor
    """(tokens, k) int64: the chosen experts of each token, best first."""
    gates: torch.Tensor
    """(tokens, k) fp32: each choice's weight in the combined output (differentiable)."""
    probs: torch.Tensor
    """(tokens, E) fp32: the router's probabilities (softmax or sigmoid scores), differentiable;
    what the balancing loss averages."""


def _routing_precision(logits: torch.Tensor) -> torch.Tensor:
    """The logits in fp32, or as they are when wider (fp64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def softmax_top_k(logits: torch.Tensor, k: int) -> Routing:
    """Mixtral's routing of (tokens, E) logits: the k most probable experts under a softmax; the
    gates are their probabilities renormalised to sum to 1 (Hugging Face's MixtralTopKRouter)."""
    probs = torch.softmax(_routing_precision(logits), dim=-1)
    top, experts = probs.topk(k, dim=-1)
    return Routing(experts, top / top.sum(dim=-1, keepdim=True), probs)


def sigmoid_top_k(
    logits: torch.Tensor, k: int, bias: torch.Tensor | None, scale: float = 1.0
) -> Routing:
    """DeepSeek-V3's routing of (tokens, E) logits: each expert scores sigmoid(logit); the k best
    of score + `bias` are chosen (`bias` (E,) moves only the choice and has no gradient; None is
    no bias). The gates are the chosen scores normalised to sum to 1, times `scale`
    (routed_scaling_factor)."""
    scores = torch.sigmoid(_routing_precision(logits))
    choice = scores.detach() if bias is None else scores.detach() + bias
    experts = choice.topk(k, dim=-1).indices
    chosen = scores.gather(-1, experts)
    return Routing(experts, chosen / chosen.sum(dim=-1, keepdim=True) * scale, scores)


def balancing_loss(
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    total_tokens: int,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss E * sum_i f_i * P_i, over a set of `total_tokens`
    tokens of which `probs` (tokens, E) and `experts` (tokens, k) are a shard. f_i is expert i's
    share of the set's (token, choice) pairs, from `counts` (E,), the set's pairs per expert
    (None: count `experts`, the shard is the set); P_i is its probability summed over the shard's
    tokens over `total_tokens`. The shards' values sum to the set's; uniform routing with uniform
    probabilities gives 1. Only P carries gradient. (Hugging Face's Mixtral loss is k times this:
    its f sums to k.)"""
    if counts is None:
        counts = expert_counts(experts, num_experts)
    # An empty set has nothing routed and no probabilities: its loss is 0, not 0 / 0.
    share = counts.to(probs) / max(total_tokens * experts.shape[-1], 1)
    mean_probs = probs.sum(dim=0) / max(total_tokens, 1)
    return num_experts * (share * mean_probs).sum()


def z_loss(logits: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """ST-MoE's router z-loss: logsumexp(logits)**2 summed over these (tokens, E) logits and
    divided by `total_tokens`, the tokens of the whole set (the shards' values sum to the set's
    mean). It keeps the logits small, where bf16 resolves them finely."""
    lse = torch.logsumexp(_routing_precision(logits), dim=-1)
    return lse.square().sum() / max(total_tokens, 1)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64 number of (token, choice) pairs of (tokens, k) `experts` routed to each expert.
    A scatter-add rather than torch.bincount, which on CUDA reads the ids' min and max back to
    the host."""
    ids = experts.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))


def update_bias(
    bias: torch.Tensor, counts: torch.Tensor, rate: float, applied: torch.Tensor | float = 1.0
) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: each expert's `bias` (E,) moves by
    `rate`, up when it took fewer pairs than the mean of `counts` (E,), down when more (counts of
    the whole global batch, summed over ranks by the caller); not at all where `applied` (a
    flag, on the device when the step's verdict is) is 0."""
    # sum - E * count has the sign of mean - count, and is exact in integers.
    under_load = torch.sign(counts.sum() - counts * counts.numel())
    bias.add_(under_load.to(bias) * applied, alpha=rate)


def capacity(tokens: int, num_experts: int, k: int, factor: float) -> int:
    """GShard's expert capacity, the most (token, choice) pairs an expert takes from `tokens`
    tokens: ceil(factor * tokens * k / num_experts); factor 1 is an even share."""
    # Rounded first: 1.1 * 10 is 11.000000000000002 in floats, whose ceiling is 12.
    return math.ceil(round(factor * tokens * k / num_experts, 6))


def drop_over_capacity(experts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (token, choice) pairs of (tokens, k) `experts` fit in their expert's `capacity`.
    Each expert keeps the first `capacity` pairs routed to it in GShard's priority order: every
    token's first choice before any second choice, then token order. Returns the (tokens, k)
    keep mask and the number of pairs dropped (a 0-d tensor: counted on the host, it would
    wait for the device in every MoE layer); the caller does not dispatch the dropped pairs
    (their output is zero)."""
    tokens, k = experts.shape
    by_priority = experts.t().flatten()  # (k * tokens,): all first choices, then all second, ...
    order = torch.argsort(by_priority, stable=True)  # grouped by expert, priority kept within
    grouped = by_priority[order]
    index = torch.arange(grouped.numel(), device=experts.device)
    group_starts = torch.ones_like(grouped, dtype=torch.bool)
    group_starts[1:] = grouped[1:] != grouped[:-1]
    first_of_group = (index * group_starts).cummax(dim=0).values
    place = torch.empty_like(index).scatter_(0, order, index - first_of_group)  # in its expert
    keep = (place < capacity).view(k, tokens).t()
    return keep, keep.numel() - keep.sum()
