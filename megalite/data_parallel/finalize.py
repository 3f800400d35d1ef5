"""Every gradient fix-up after backward, in one place (Megatron-LM's finalize_model_grads):

1. finish the data-parallel reduction of every bucket (reduce-scatter or all-reduce);
2. sum over tp the gradients of tp-replicated parameters that each tp rank saw only part of
   (norm weights and row-parallel biases under sequence parallelism, shared kv heads);
3. sum GPT's tied embedding gradient over the first and last pipeline stage (under zb-v both
   are chunks of pp rank 0: summed there, without communication).

The sums commute, so doing dp first lets its communication overlap backward; steps 2 and 3 act
on the elements this rank owns, which line up across the ranks of those groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megalite import comm
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import PARTIAL, ParamMeta, param_parts


def _owned_parts(buffer: GradBuffer, param: nn.Parameter) -> list[tuple[int, int, ParamMeta]]:
    """Where each global tensor `param` holds (itself, or the parts of a fused parameter)
    meets this rank's owned pieces: (owned start, owned end, that tensor's meta)."""
    found = []
    for start, end, offset in buffer.owned_segments(param):
        for _, meta, lo, hi in param_parts("", param):
            lo, hi = max(lo, offset), min(hi, offset + end - start)
            if lo < hi:
                found.append((start + lo - offset, start + hi - offset, meta))
    return found


def _owned_grads(
    buffers: list[GradBuffer], select: Callable[[ParamMeta], bool]
) -> list[torch.Tensor]:
    """The owned gradients of the global tensors `select` picks (a fused parameter's parts each
    by their own meta: a shared kv head, not the q rows beside it)."""
    return [
        buffer.owned_grads[start:end]
        for buffer in buffers
        for param in buffer.params
        for start, end, meta in _owned_parts(buffer, param)
        if select(meta)
    ]


def _sum_owned(buffers: list[GradBuffer], select: Callable[[ParamMeta], bool], group: Any) -> None:
    """Sum over `group` the owned gradients of the global tensors `select` picks."""
    if comm.size(group) == 1:
        return
    pieces = _owned_grads(buffers, select)
    if not pieces:
        return
    flat = torch.cat(pieces)
    comm.all_reduce(flat, group)
    offset = 0
    for piece in pieces:
        piece.copy_(flat[offset : offset + piece.numel()])
        offset += piece.numel()


def _tied(meta: ParamMeta) -> bool:
    """Partial over pp: GPT's tied embedding, a copy on the first and on the last stage."""
    return meta.placement("pp") == PARTIAL


def finalize_grads(buffers: list[GradBuffer], ps: ParallelState) -> None:
    for buffer in buffers:
        buffer.finish_sync()
    _sum_owned(buffers, lambda meta: meta.placement("tp") == PARTIAL, ps.group("tp"))
    originals = _owned_grads(buffers, lambda meta: _tied(meta) and meta.tied_name is None)
    copies = _owned_grads(buffers, lambda meta: _tied(meta) and meta.tied_name is not None)
    if originals and copies:  # both tied copies on this rank (zb-v's first rank): own buckets
        for original, copy in zip(originals, copies, strict=True):
            original.add_(copy)
            copy.copy_(original)
    elif ps.size("pp") > 1:
        _sum_owned(buffers, _tied, ps.embedding_group)
