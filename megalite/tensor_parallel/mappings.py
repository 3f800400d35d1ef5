"""Autograd-aware collectives for tensor and sequence parallelism (Shoeybi et al. 2019,
Korthikanti et al. 2022). Each pair is a collective in forward and its conjugate in backward.

Activations are laid out (batch, seq, hidden); the "sequence" functions work on dim 1 and the
"tensor-parallel region" functions on the last dim. At tp = 1 every function is the identity.
Each is opaque to torch.compile: collectives stay eager between compiled pieces
(training/compile.py).
"""

from __future__ import annotations

from typing import Any

import torch

from megalite import comm
from megalite.eager_boundary import eager_only

SEQ_DIM = 1


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
    """forward: all-gather along the sequence; backward: reduce-scatter along the sequence
    (the gathered activation feeds tensor-parallel layers whose grads are partial sums)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad, ctx.group, dim=SEQ_DIM), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """forward: reduce-scatter the partial sums along the sequence; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x, group, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=SEQ_DIM), None


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
