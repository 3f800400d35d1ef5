"""Autograd-aware collectives for tensor and sequence parallelism (Shoeybi et al. 2019,
Korthikanti et al. 2022). Each pair is a collective in forward and its conjugate in backward.

Activations are laid out (batch, seq, hidden), as in nanoGPT. Under sequence parallelism (SP)
rank r of t keeps the r-th contiguous 1/t of a micro-batch's b*s tokens, held in the shape
(b, s/t, h) (`sequence_shard`; at b = 1 the r-th piece of the sequence). The work between the
tensor-parallel regions (norms, dropout, residual adds, biases) is token-wise and does not care
which tokens a rank holds, and contiguous pieces make the SP all-gather and reduce-scatter free
of copies: what Megatron's (s, b, h) layout gets by splitting s (its pieces are contiguous runs
of tokens too), without transposing the model's activations. The "tensor-parallel region"
functions work on the last dim. At tp = 1 every function is the identity. Each is opaque to
torch.compile: collectives stay eager between compiled pieces (training/compile.py).
"""

from __future__ import annotations

from typing import Any

import torch

from megalite import comm
from megalite.eager_boundary import eager_only


def _token_rows(full: torch.Tensor, world: int) -> torch.Tensor:
    """(b, s, ...) as (world * b, s / world, ...): rows [r*b, (r+1)*b) are rank r's tokens."""
    b, s = full.shape[:2]
    if s % world:
        raise ValueError(f"a sequence of {s} tokens does not split over {world} ranks")
    return full.reshape(world * b, s // world, *full.shape[2:])


def _from_token_rows(rows: torch.Tensor, world: int) -> torch.Tensor:
    """The inverse of `_token_rows`: (world * b, s / world, ...) as (b, s, ...)."""
    return rows.view(rows.shape[0] // world, world * rows.shape[1], *rows.shape[2:])


def sequence_shard(full: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's SP shard of a (b, s, ...) tensor: its contiguous 1/t of the b*s tokens, shaped
    (b, s/t, ...) (no communication; a view of a contiguous `full`)."""
    world = comm.size(group)
    if world == 1:
        return full
    b = full.shape[0]
    start = comm.rank(group) * b
    return _token_rows(full, world)[start : start + b]


def shard_tokens(shard: torch.Tensor, group: Any) -> slice:
    """Where this rank's SP shard (b, s/t, ...) lies among the full tensor's b*s tokens,
    flattened in order: [rank * b*s/t, (rank + 1) * b*s/t)."""
    count = shard.shape[0] * shard.shape[1]
    start = comm.rank(group) * count
    return slice(start, start + count)


def all_gather_sequence_start(shard: torch.Tensor, group: Any) -> comm.Pending:
    """Start gathering every rank's SP shard (b, s/t, ...) into the full (b, s, ...): the pieces
    arrive in token order, so the result needs no copy."""
    world = comm.size(group)
    gather = comm.all_gather_start(shard, group, dim=0)
    return comm.Pending(None, lambda: _from_token_rows(gather.wait(), world))


def all_gather_sequence(shard: torch.Tensor, group: Any) -> torch.Tensor:
    """The full (b, s, ...) tensor from every rank's SP shard."""
    return all_gather_sequence_start(shard, group).wait()


def all_gather_sequence_together_start(shards: list[torch.Tensor], group: Any) -> comm.Pending:
    """Start `all_gather_sequence` of each shard (one dtype) in one collective; `wait()` returns
    the list of full tensors."""
    world = comm.size(group)
    gather = comm.all_gather_together_start(shards, group, dim=0)
    return comm.Pending(None, lambda: [_from_token_rows(full, world) for full in gather.wait()])


def reduce_scatter_sequence_start(full: torch.Tensor, group: Any) -> comm.Pending:
    """Start summing (b, s, ...) over the group into this rank's SP shard (b, s/t, ...): its
    pieces are contiguous, so nothing is copied to send them."""
    return comm.reduce_scatter_start(_token_rows(full, comm.size(group)), group, dim=0)


def reduce_scatter_sequence(full: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's SP shard of `full` summed over the group."""
    return reduce_scatter_sequence_start(full, group).wait()


class _CopyToTPRegion(torch.autograd.Function):
    """forward: identity; backward: all-reduce the grad over tp (the input fed every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTPRegion(torch.autograd.Function):
    """forward: all-reduce the partial sums over tp; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        comm.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTPRegion(torch.autograd.Function):
    """forward: all-gather along the last dim; backward: keep this rank's slice of the grad."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return comm.split(grad, ctx.group, dim=-1), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """forward: all-gather the sequence shards; backward: reduce-scatter to them (the gathered
    activation feeds tensor-parallel layers whose grads are partial sums)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """forward: reduce-scatter the partial sums to sequence shards; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


@eager_only
def copy_to_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if comm.size(group) == 1 else _CopyToTPRegion.apply(x, group)


@eager_only
def reduce_from_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if comm.size(group) == 1 else _ReduceFromTPRegion.apply(x, group)


@eager_only
def gather_from_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if comm.size(group) == 1 else _GatherFromTPRegion.apply(x, group)


@eager_only
def gather_from_sequence_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if comm.size(group) == 1 else _GatherFromSequenceRegion.apply(x, group)


@eager_only
def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if comm.size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)
