"""Contiguous parameter and fp32 gradient storage, cut into buckets whose data-parallel
reduction overlaps the rest of backward (Megatron-LM's param-and-grad buffer; PyTorch DDP's
gradient buckets).

Every parameter of one model chunk and dtype becomes a view into `params_flat`, and its
gradient accumulates into the matching view of `grads_flat` (`param.main_grad`, fp32 whatever
the parameter dtype). Buckets are laid out in backward order, so the first bucket fills first.
During the backward of the last micro-batch, a bucket is reduced as soon as all its gradients
are in: reduce-scattered when the optimizer is sharded (ZeRO-1), all-reduced otherwise.

Ownership (Megatron's distributed optimizer): every bucket is padded to a multiple of dp and
data-parallel rank r owns the r-th contiguous piece of each bucket. With ZeRO-0 a rank owns
everything. "Owned coordinates" index the concatenation of a rank's owned pieces, which is how
the optimizer lays out its master weights and Adam state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megalite import comm
from megalite.parallel_state import ParallelState


@dataclass
class Bucket:
    start: int
    end: int
    params: list[nn.Parameter]
    pending: int = 0
    handle: Any = None
    owned: slice = field(default_factory=lambda: slice(0, 0))
    """This rank's piece of the bucket in owned coordinates (its place in `owned_grads`)."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class GradBuffer:
    """Flat storage for `params` (all of one dtype, given in backward order)."""

    params: list[nn.Parameter]
    ps: ParallelState
    bucket_numel: int
    shard_optimizer: bool
    own_bucket: set[nn.Parameter] = field(default_factory=set)
    """Parameters that get a bucket to themselves (tied embeddings under ZeRO-1, so the first
    and last pipeline stage shard them identically and can sum their owned pieces)."""

    def __post_init__(self) -> None:
        dp = self.ps.dp_size
        self.sharded = self.shard_optimizer and dp > 1
        self.buckets: list[Bucket] = []
        self.offsets: dict[nn.Parameter, int] = {}
        offset, current = 0, []

        def close() -> None:
            nonlocal offset, current
            if current:
                start = self.offsets[current[0]]
                end = start + -(-(offset - start) // dp) * dp  # pad to a multiple of dp
                self.buckets.append(Bucket(start, end, current))
                offset, current = end, []

        for param in self.params:
            if param in self.own_bucket:
                close()
            self.offsets[param] = offset
            offset += param.numel()
            current.append(param)
            if param in self.own_bucket or offset - self.offsets[current[0]] >= self.bucket_numel:
                close()
        close()

        dtype, device = self.params[0].dtype, self.params[0].device
        self.params_flat = torch.zeros(offset, dtype=dtype, device=device)
        self.grads_flat = torch.zeros(offset, dtype=torch.float32, device=device)
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        for bucket in self.buckets:
            for param in bucket.params:
                self.bucket_of[param] = bucket
                self._adopt(param)
        self.owned_ranges = [self.owned_range(b) for b in self.buckets]
        offset = 0
        for bucket, (start, end) in zip(self.buckets, self.owned_ranges):
            bucket.owned = slice(offset, offset + end - start)
            offset += end - start
        owned = sum(end - start for start, end in self.owned_ranges)
        self.owned_grads = (
            torch.zeros(owned, dtype=torch.float32, device=device)
            if self.sharded
            else self.grads_flat
        )
        self.sync_enabled = False
        self.reset()

    def _adopt(self, param: nn.Parameter) -> None:
        start = self.offsets[param]
        view = self.params_flat[start : start + param.numel()]
        view.copy_(param.data.view(-1))
        param.data = view.view_as(param)
        param.main_grad = self.grads_flat[start : start + param.numel()].view_as(param)
        param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's piece of a bucket, in buffer coordinates."""
        if not self.sharded:
            return bucket.start, bucket.end
        piece = bucket.numel // self.ps.dp_size
        start = bucket.start + self.ps.dp_rank * piece
        return start, start + piece

    def owned_segments(self, param: nn.Parameter) -> list[tuple[int, int, int]]:
        """Where `param` meets this rank's owned pieces: (owned start, owned end, offset of that
        stretch inside the flattened parameter)."""
        segments, owned_offset = [], 0
        p_start = self.offsets[param]
        p_end = p_start + param.numel()
        for start, end in self.owned_ranges:
            lo, hi = max(start, p_start), min(end, p_end)
            if lo < hi:
                segments.append(
                    (owned_offset + lo - start, owned_offset + hi - start, lo - p_start)
                )
            owned_offset += end - start
        return segments

    # ------------------------------------------------------------------ gradient sync

    def reset(self) -> None:
        """Start a step. Rather than zeroing the buffer, each parameter's first gradient of the
        step is copied in and later ones are added (fp32: by autograd, in place)."""
        self.arrived: set[nn.Parameter] = set()
        for param in self.params:
            param.grad = None
        for bucket in self.buckets:
            bucket.pending, bucket.handle = len(bucket.params), None

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param not in self.arrived:
            self.arrived.add(param)
            param.main_grad.copy_(param.grad)
            # fp32: let autograd accumulate the next micro-batches straight into the buffer
            param.grad = param.main_grad if param.dtype == torch.float32 else None
        elif param.dtype != torch.float32:
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.sync_enabled:
            bucket = self.bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if self.ps.dp_size == 1:
            return
        grads = self.grads_flat[bucket.start : bucket.end]
        if self.sharded:
            bucket.handle = comm.reduce_scatter_flat(
                self.owned_grads[bucket.owned], grads, self.ps.dp_group, async_op=True
            )
        else:
            bucket.handle = comm.all_reduce(grads, self.ps.dp_group, async_op=True)

    def start_sync(self) -> None:
        """Reduce each bucket over dp as soon as it is complete, from now on (last micro-batch)."""
        self.sync_enabled = True

    def finish_sync(self) -> None:
        """Wait for every bucket (launching any whose gradients never arrived)."""
        for param in self.params:
            if param not in self.arrived:  # no gradient this step: zero, not last step's
                param.main_grad.zero_()
        for bucket in self.buckets:
            if bucket.handle is None and bucket.pending > 0:
                bucket.pending = 0
                self._launch(bucket)
            if bucket.handle is not None:
                bucket.handle.wait()
        self.sync_enabled = False

    # ------------------------------------------------------------------ parameter sync

    def all_gather_params(self) -> None:
        """After the optimizer updated this rank's owned pieces, give every dp rank all of
        them (ZeRO-1); nothing to do when every rank owns everything."""
        if not self.sharded:
            return
        for bucket, (start, end) in zip(self.buckets, self.owned_ranges):
            comm.all_gather_flat(
                self.params_flat[bucket.start : bucket.end],
                self.params_flat[start:end].clone(),
                self.ps.dp_group,
            )


def build_grad_buffers(
    chunks: list[nn.Module],
    ps: ParallelState,
    bucket_mb: float,
    shard_optimizer: bool,
    own_bucket: set[nn.Parameter] = frozenset(),
) -> list[GradBuffer]:
    """One buffer per (model chunk, parameter dtype), parameters in reverse (backward) order."""
    buffers = []
    bucket_numel = max(1, int(bucket_mb * 2**20 / 4))
    for chunk in chunks:
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in reversed(list(chunk.parameters())):
            by_dtype.setdefault(param.dtype, []).append(param)
        for params in by_dtype.values():
            buffers.append(GradBuffer(params, ps, bucket_numel, shard_optimizer, set(own_bucket)))
    return buffers
