"""Contiguous parameter and fp32 gradient storage, cut into buckets whose data-parallel
reduction overlaps the rest of backward (Megatron-LM's param-and-grad buffer; PyTorch DDP's
gradient buckets).

Every parameter of one model chunk and dtype becomes a view into `params_flat`, and its
gradient accumulates into the matching view of `grads_flat` (`param.main_grad`, fp32 whatever
the parameter dtype). Buckets are laid out in backward order, so the first bucket fills first.
During the backward of the last micro-batch, a bucket is reduced as soon as all its gradients
are in: reduce-scattered when the optimizer is sharded (ZeRO-1), all-reduced otherwise.
Tensor-parallel linears add their weight and bias gradients in fp32 straight into the main grad
(or ZeRO-2's staging) through `param.accumulate_main_grad` (Megatron's gradient-accumulation
fusion): no 16-bit `.grad` in between, and the bucket counts the gradient as arrived at once.
A fused parameter (q/k/v, gate/up) holds several global tensors (`ParamMeta.parts`); the
fix-ups and the optimizer select by each part's meta (`finalize`, `optimizer.distributed`), so
a shared kv head's rows are summed over tp and the query rows beside it are not.

Under a zero-bubble schedule's split backward the linears' weight gradients arrive in the W
step (`tensor_parallel.deferred`), and so does every other gradient: during B a parameter keeps
its `.grad` (a 16-bit one is taken from it, so that a later B cannot add into it in 16 bits)
and its arrival is queued for W, in autograd's order. A micro-batch's gradients
thus all arrive in one step, as in a plain backward, and the counting, ZeRO-2's staging and
the reduction of the last micro-batch's buckets work on W steps unchanged.

ZeRO-2 (sharded gradients) keeps no full-size gradient buffer: a bucket's fp32 gradients are
staged in a bucket-sized tensor taken when its first gradient of a backward arrives, and every
micro-batch's bucket is reduce-scattered as soon as it is complete and added into this rank's
owned piece, then released (the caching allocator reuses it). Completing a bucket folds in the
reductions launched before it, so what is alive is the bucket just completed, the one before it
whose reduction is in flight, and any begun early (GPT's token embedding, used by the head too,
gets its gradient last); `profiling.parameters` replays this policy for the estimate.

After the optimizer step, the updated parameters are all-gathered asynchronously, bucket by
bucket in the order the next forward uses them (Megatron-LM's overlapped parameter gather):
a forward pre-hook on every module that owns parameters waits for their buckets only, so layer
0 computes while later layers' parameters are still arriving.

ZeRO-3 (sharded parameters) keeps only the owned pieces of the 16-bit parameters
(`params_owned`): each bucket's full parameters live in a storage of the bucket's own, which its
parameters are views of, allocated and gathered when a unit (`zero3`) is about to run and
released after its forward, and again once the bucket's gradients of a backward are all in.
Buckets are cut at unit boundaries, and the optimizer step leaves the gathering to the units.
With the optimizer offloaded (`offload_params`, ZeRO-Infinity's CPU tier) the owned pieces live
in host memory (pinned on CUDA), where the update writes them: each gather first brings its
owned piece up on a stream of its own, and the all-gather follows it there, so both run under
the unit that is computing.

Ownership (Megatron's distributed optimizer): every bucket is padded to a multiple of dp and
data-parallel rank r owns the r-th contiguous piece of each bucket. With ZeRO-0 a rank owns
everything. Under HSDP (`parallel.dp_replicate`) "dp" here is the shard group (cp x dp_shard),
and each owned piece's gradient is all-reduced over its copies after the step's last
reduction (`_sum_over_copies`). "Owned coordinates" index the concatenation of a rank's owned
pieces, which is how the optimizer lays out its master weights and Adam state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megalite import comm
from megalite.data_parallel.zero3 import ShardedUnits, has_forward, parameter_units, unit_index
from megalite.host_memory import HostArena
from megalite.kernels import wgrad_accumulate
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.deferred import Deferral
from megalite.tensor_parallel.linear import Rows


@dataclass
class Bucket:
    start: int
    end: int
    params: list[nn.Parameter]
    pending: int = 0
    handle: Any = None
    owned: slice = field(default_factory=lambda: slice(0, 0))
    """This rank's piece of the bucket in owned coordinates (its place in `owned_grads`)."""
    staging: torch.Tensor | None = None
    """ZeRO-2: this backward's fp32 gradients of the bucket, until their reduction is added."""
    received: torch.Tensor | None = None
    """ZeRO-2: this rank's piece of the reduced staging, while its reduce-scatter is in flight."""
    reduced: bool = False
    """ZeRO-2: the owned piece already holds a micro-batch's gradient of this step."""
    gather: tuple[Any, torch.Tensor] | None = None
    """(handle, source) of the parameter all-gather in flight for this bucket."""
    full: torch.Tensor | None = None
    """ZeRO-3: the bucket's full 16-bit parameters, in a storage of its own that is allocated
    only while they are gathered (its parameters are views of it)."""

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
    shard_grads: bool = False
    """ZeRO-2: keep fp32 gradients for the owned pieces only (needs shard_optimizer)."""
    fuse_wgrad: bool = True
    """Let tensor-parallel linears add their weight gradients straight into the fp32 main
    grads (`accumulate_main_grad`); False: they return a `.grad` like any other parameter."""
    deferral: Deferral | None = None
    """The model's deferral of weight gradients (its linears'), which a split backward's B step
    opens: while it is open, every gradient's arrival waits for the W step too."""
    shard_params: bool = False
    """ZeRO-3: keep only the owned pieces of the 16-bit parameters between uses; a bucket's
    full parameters are gathered for a forward or backward and released after (needs
    shard_grads)."""
    unit_of: dict[nn.Parameter, int] = field(default_factory=dict)
    """ZeRO-3: the unit (`zero3.unit_index`) of each parameter. A bucket never spans two
    units, so that a unit's gathers bring its parameters and no other unit's."""
    offload_params: bool = False
    """ZeRO-3 with the optimizer on the host: keep the owned pieces of the parameters there,
    between uses, and bring each up for its gather."""
    keep_gathered: bool = False
    """ZeRO-3 (`parallel.reshard_after_forward=false`): release the gathered parameters only
    once the step's gradients are reduced, not after each forward and backward."""

    @property
    def replica_group(self) -> Any:
        """The ranks holding the same parameters as this buffer's."""
        return self.ps.group(*self.replica_axes)

    @property
    def replica_size(self) -> int:
        return self.ps.size(*self.replica_axes)

    @property
    def shard_group(self) -> Any:
        """The ranks over which ZeRO shards this buffer (all its replicas, but under HSDP)."""
        return self.ps.group(*self.shard_axes)

    @property
    def shard_size(self) -> int:
        return self.ps.size(*self.shard_axes)

    @property
    def shard_rank(self) -> int:
        return self.ps.coord(*self.shard_axes)

    @property
    def replicate_group(self) -> Any:
        """HSDP: the ranks holding copies of this rank's shard (None: no copies)."""
        return self.ps.group(*self.replicate_axes)

    @property
    def first_copy(self) -> bool:
        """Whether this rank holds the first copy of its owned shard: it alone counts the shard
        in the gradient norm and writes it to checkpoints (every rank, but under HSDP)."""
        return self.ps.coord(*self.replicate_axes) == 0

    @property
    def weight_axes(self) -> tuple[str, ...]:
        """The axes along which ranks hold other pieces of its parameters' view of the model."""
        return self.ps.dims.view_of(self.replica_axes).weight_axes

    def __post_init__(self) -> None:
        # The axes its parameters are replicas over (`ParamMeta.replica_axes`): dp x cp for the
        # dense weights, cp x edp for the experts. Its gradients are reduced, and its state
        # sharded, over them.
        (self.replica_axes,) = {param.meta.replica_axes(self.ps.dims) for param in self.params}
        # HSDP shards the dense weights over cp x dp_shard and keeps dp_replicate copies of
        # each shard; unsharded (shards of one rank), one all-reduce over every replica
        self.shard_axes, replicate_axes = self.ps.dims.shard_and_replicate(self.replica_axes)
        dp = self.shard_size
        self.sharded = self.shard_optimizer and dp > 1
        self.replicate_axes = replicate_axes if self.sharded else ()
        self.grads_sharded = self.shard_grads and self.sharded
        self.params_sharded = self.shard_params and self.grads_sharded
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
            if param in self.own_bucket or (
                current and self.unit_of.get(param) != self.unit_of.get(current[0])
            ):
                close()
            self.offsets[param] = offset
            offset += param.numel()
            current.append(param)
            if param in self.own_bucket or offset - self.offsets[current[0]] >= self.bucket_numel:
                close()
        close()

        dtype, self.device = self.params[0].dtype, self.params[0].device
        self.params_flat = (
            None if self.params_sharded else torch.zeros(offset, dtype=dtype, device=self.device)
        )
        for bucket in self.buckets if self.params_sharded else ():
            bucket.full = torch.zeros(bucket.numel, dtype=dtype, device=self.device)
        self.grads_flat = (
            None
            if self.grads_sharded
            else torch.zeros(offset, dtype=torch.float32, device=self.device)
        )
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
        self.params_owned: torch.Tensor | None = None
        """ZeRO-3: the owned pieces of the 16-bit parameters, in owned coordinates (on the host
        under `offload_params`)."""
        self.offload_params = self.offload_params and self.params_sharded
        on_cuda = self.offload_params and self.device.type == "cuda"
        self.upload_stream = torch.cuda.Stream(self.device) if on_cuda else None
        """Where the offloaded pieces come up, and their gathers run (CUDA only)."""
        if self.params_sharded:
            self._keep_owned_params(owned)
        self.owned_grads = (
            torch.zeros(owned, dtype=torch.float32, device=self.device)
            if self.sharded
            else self.grads_flat
        )
        self.in_flight: list[Bucket] = []
        """ZeRO-2: staged buckets whose reduce-scatter is launched, oldest first."""
        self.staging_bytes = 0
        self.staging_peak = 0
        """ZeRO-2: most bytes of staging (and received pieces) held at once so far."""
        self.sync_enabled = False
        self.reset()

    def _adopt(self, param: nn.Parameter) -> None:
        start = self.offsets[param]
        view = self._param_storage(param)
        view.copy_(param.data.view(-1))
        param.data = view.view_as(param)
        if self.grads_flat is not None:
            param.main_grad = self.grads_flat[start : start + param.numel()].view_as(param)
        param.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.fuse_wgrad:
            param.accumulate_main_grad = functools.partial(self._accumulate, param)

    def _keep_owned_params(self, owned: int) -> None:
        """ZeRO-3, once built: copy each bucket's owned piece of the parameters out, then
        release the bucket, so that from now on a rank holds its owned pieces alone."""
        dtype = self.params[0].dtype
        if self.offload_params:
            self.host_params = HostArena([(owned, dtype)], pin=self.device.type == "cuda")
            self.params_owned = self.host_params.views[0]
        else:
            self.params_owned = torch.empty(owned, dtype=dtype, device=self.device)
        for bucket, (start, end) in zip(self.buckets, self.owned_ranges):
            piece = bucket.full[start - bucket.start : end - bucket.start]
            self.owned_params(bucket).copy_(piece)
            self.release_params(bucket)

    def _param_storage(self, param: nn.Parameter) -> torch.Tensor:
        """The 1-D stretch of 16-bit storage `param` is a view of: of the buffer's, or (ZeRO-3)
        of its bucket's own, which is released and gathered again without `param` changing."""
        if not self.params_sharded:
            start = self.offsets[param]
            return self.params_flat[start : start + param.numel()]
        bucket = self.bucket_of[param]
        start = self.offsets[param] - bucket.start
        return bucket.full[start : start + param.numel()]

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's piece of a bucket, in buffer coordinates."""
        if not self.sharded:
            return bucket.start, bucket.end
        piece = bucket.numel // self.shard_size
        start = bucket.start + self.shard_rank * piece
        return start, start + piece

    def owned_params(self, bucket: Bucket) -> torch.Tensor:
        """This rank's piece of the bucket's 16-bit parameters (a view), which the optimizer
        updates: ZeRO-3 keeps it apart from the bucket's full parameters, which come and go."""
        if self.params_sharded:
            return self.params_owned[bucket.owned]
        start, end = self.owned_range(bucket)
        return self.params_flat[start:end]

    def param_tensors(self) -> list[torch.Tensor]:
        """The 16-bit parameter storage resident on the device now: the full buffer, or
        (ZeRO-3) the owned pieces, unless they are offloaded, and the buckets gathered at the
        moment (none between steps)."""
        if not self.params_sharded:
            return [self.params_flat]
        gathered = [b.full for b in self.buckets if self.is_gathered(b)]
        return gathered if self.offload_params else [self.params_owned, *gathered]

    def host_param_tensors(self) -> list[torch.Tensor]:
        """The parameter storage on the host: the owned pieces under `offload_params`."""
        return [self.params_owned] if self.offload_params else []

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

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The long-lived fp32 gradient storage: the full buffer and (ZeRO-1) the owned shard it
        is reduce-scattered into, or (ZeRO-2) the owned shard alone."""
        tensors = [] if self.grads_flat is None else [self.grads_flat]
        return tensors + ([self.owned_grads] if self.sharded else [])

    # ------------------------------------------------------------------ gradient sync

    def reset(self) -> None:
        """Start a step. Rather than zeroing the buffer, each parameter's first gradient of the
        step is copied in and later ones are added (fp32: by autograd, in place)."""
        self.arrived: set[nn.Parameter] = set()
        for param in self.params:
            param.grad = None
        for bucket in self.buckets:
            bucket.pending, bucket.handle, bucket.reduced = len(bucket.params), None, False

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None:  # a fused linear: `_accumulate` has reported it
            return
        queue = None if self.deferral is None else self.deferral.queue
        if queue is None:
            self._arrive(param)
        elif param.dtype == torch.float32:  # a split backward's B: it arrives in its W
            queue.put(functools.partial(self._arrive, param))
        else:
            # 16-bit: taken from the parameter now, or a later B would add its gradient into
            # this one in 16 bits (a bf16 sum, an fp16 overflow) before the W that moves it
            grad, param.grad = param.grad, None
            queue.put(functools.partial(self._arrive, param, grad))

    def _arrive(self, param: nn.Parameter, taken: torch.Tensor | None = None) -> None:
        """Move `param.grad` (or the 16-bit gradient `taken` from it in a split backward's B)
        into the main grad (or ZeRO-2's staging), counting it as arrived. Under a split
        backward, a later B may have added into an fp32 `.grad` before this W ran: this moves
        both, and that B's W finds nothing left to move (but still counts). A 16-bit `.grad` is
        always None here: each B takes its own."""
        grad = param.grad if taken is None else taken
        if self.grads_sharded:
            if grad is not None:
                self._staged(param).add_(grad)
                param.grad = None
                self._stage_done(param)
            return
        if param not in self.arrived:
            self.arrived.add(param)
            param.main_grad.copy_(grad)
            # fp32: let autograd accumulate the next micro-batches straight into the buffer
            param.grad = param.main_grad if param.dtype == torch.float32 else None
        elif param.dtype != torch.float32 and grad is not None:
            param.main_grad.add_(grad)
            param.grad = None
        self._count_arrival(param)

    def _accumulate(
        self, param: nn.Parameter, dy: torch.Tensor, x: torch.Tensor | None, rows: Rows
    ) -> None:
        """A tensor-parallel linear's weight gradient dy^T x (dy (tokens, out), x (tokens, in);
        only `rows` of the weight when given, dy's columns in their order; a bias, x None: dy
        summed over the tokens), added in fp32 straight into the main grad, or ZeRO-2's
        staging: no `.grad` in between, and the bucket counts it as arrived."""
        if self.grads_sharded:
            target, first = self._staged(param), False
        else:
            target, first = param.main_grad, param not in self.arrived
            self.arrived.add(param)
        if rows is None:
            _add_wgrad(target, dy, x, first)
        else:
            if first:  # the other rows get no gradient on this rank
                target.zero_()
            start = 0
            for piece in rows:
                end = start + piece.stop - piece.start
                _add_wgrad(target[piece], dy[:, start:end], x, False)
                start = end
        if self.grads_sharded:
            self._stage_done(param)
        else:
            self._count_arrival(param)

    def _count_arrival(self, param: nn.Parameter) -> None:
        if self.sync_enabled:
            bucket = self.bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if self.replica_size == 1:
            return
        grads = self.grads_flat[bucket.start : bucket.end]
        if self.sharded:
            bucket.handle = comm.reduce_scatter_flat(
                self.owned_grads[bucket.owned], grads, self.shard_group, async_op=True
            )
        else:
            bucket.handle = comm.all_reduce(grads, self.replica_group, async_op=True)

    def start_sync(self) -> None:
        """Reduce each bucket over dp as soon as it is complete, from now on: called before the
        step that completes the last micro-batch's gradients (its B, or W under a split
        backward)."""
        self.sync_enabled = True

    def finish_sync(self) -> None:
        """Wait for every bucket (launching any whose gradients never arrived); under HSDP,
        then sum each owned shard over its copies."""
        self.sync_enabled = False
        if self.grads_sharded:
            self.end_backward()
            for bucket in self.buckets:
                if not bucket.reduced:  # no gradient this step: zero, not last step's
                    self.owned_grads[bucket.owned].zero_()
            if self.params_sharded:  # kept for the step (or released already)
                self._release_all()
        else:
            for param in self.params:
                if param not in self.arrived:  # no gradient this step: zero, not last step's
                    param.main_grad.zero_()
            for bucket in self.buckets:
                if bucket.handle is None and bucket.pending > 0:
                    bucket.pending = 0
                    self._launch(bucket)
                if bucket.handle is not None:
                    bucket.handle.wait()
        self._sum_over_copies()

    def _sum_over_copies(self) -> None:
        """HSDP: all-reduce each owned shard's gradient over the copies of the shard, bucket by
        bucket with every reduction in flight at once. It follows the last reduce-scatter of
        the step: the shard sums every micro-batch of the shard group first, so the copies
        exchange 1/dp_shard of the gradient once a step (torchtitan's HSDP does the same)."""
        if self.replicate_group is None:
            return
        owned = [self.owned_grads[bucket.owned] for bucket in self.buckets]
        handles = [comm.all_reduce(shard, self.replicate_group, async_op=True) for shard in owned]
        for handle in handles:
            handle.wait()

    # ------------------------------------------------------------------ ZeRO-2 staging

    def _staged(self, param: nn.Parameter) -> torch.Tensor:
        """Where a micro-batch's gradient of `param` is added: its view of the bucket's staging
        (taken now if this is the bucket's first gradient of the backward)."""
        bucket = self.bucket_of[param]
        if bucket.handle is not None:  # a gradient after the bucket was complete: start anew
            self.in_flight.remove(bucket)
            self._add_reduced(bucket)
        if bucket.staging is None:
            bucket.staging = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
            bucket.pending = len(bucket.params)
            self._count_staging(bucket.staging.nbytes)
        start = self.offsets[param] - bucket.start
        return bucket.staging[start : start + param.numel()].view_as(param)

    def _stage_done(self, param: nn.Parameter) -> None:
        """`param`'s gradient is in the staging: reduce the bucket once it is complete."""
        bucket = self.bucket_of[param]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._reduce_staged(bucket)

    def _reduce_staged(self, bucket: Bucket) -> None:
        """Launch the bucket's reduce-scatter, then fold in every earlier one: their reductions
        overlapped the backward that filled this bucket. ZeRO-3 folds the earlier units' only:
        the prefetch of the unit before was issued on the same group ahead of this unit's
        reduce-scatters, so waiting for one of them within the unit would hold its backward
        behind that whole prefetch."""
        bucket.received = torch.empty(
            bucket.numel // self.shard_size, dtype=torch.float32, device=self.device
        )
        self._count_staging(bucket.received.nbytes)
        bucket.handle = comm.reduce_scatter_flat(
            bucket.received, bucket.staging, self.shard_group, async_op=True
        )
        self.in_flight.append(bucket)
        while self._fold_key(self.in_flight[0]) != self._fold_key(bucket):
            self._add_reduced(self.in_flight.pop(0))
        if self.params_sharded and not self.keep_gathered:  # its backward's uses are done
            self.release_params(bucket)

    def _fold_key(self, bucket: Bucket) -> Any:
        """What the in-flight reductions are folded by (`_reduce_staged`): the unit (ZeRO-3), or
        the bucket itself."""
        return self.unit_of.get(bucket.params[0]) if self.params_sharded else id(bucket)

    def _add_reduced(self, bucket: Bucket) -> None:
        bucket.handle.wait()
        owned = self.owned_grads[bucket.owned]
        if bucket.reduced:
            owned.add_(bucket.received)
        else:
            owned.copy_(bucket.received)
        bucket.reduced = True
        self._count_staging(-bucket.staging.nbytes - bucket.received.nbytes)
        bucket.staging = bucket.received = bucket.handle = None

    def _count_staging(self, nbytes: int) -> None:
        self.staging_bytes += nbytes
        self.staging_peak = max(self.staging_peak, self.staging_bytes)

    def end_backward(self) -> None:
        """ZeRO-2, after each step of this chunk that completes a micro-batch's gradients (B,
        or W under a split backward): reduce the buckets some of whose parameters got no
        gradient, and add every reduction in, so no staging outlives the step that filled it.
        ZeRO-3: release the parameters of every bucket, so none outlives the backward (unless
        they are kept for the step)."""
        if not self.grads_sharded:
            return
        for bucket in self.buckets:
            if bucket.staging is not None and bucket.handle is None:
                self._reduce_staged(bucket)
        while self.in_flight:
            self._add_reduced(self.in_flight.pop(0))
        if self.params_sharded and not self.keep_gathered:
            self._release_all()

    def _release_all(self) -> None:
        """ZeRO-3: release every bucket's gathered parameters."""
        for bucket in self.buckets:
            self.release_params(bucket)

    # ------------------------------------------------------------------ parameter sync

    def start_param_gather(self) -> None:
        """After the optimizer updated this rank's owned pieces, start giving every dp rank all
        of them (ZeRO-1/2): one asynchronous all-gather per bucket, in forward order (the
        reverse of the buckets' backward order). Nothing to do when every rank owns
        everything, nor under ZeRO-3, where each unit's forward gathers its own buckets
        (`gather_params`)."""
        if not self.sharded or self.params_sharded:
            return
        for bucket in reversed(self.buckets):
            source = self.owned_params(bucket).clone()
            full = self.params_flat[bucket.start : bucket.end]
            handle = comm.all_gather_flat(full, source, self.shard_group, async_op=True)
            bucket.gather = (handle, source)

    def is_gathered(self, bucket: Bucket) -> bool:
        """ZeRO-3: whether the bucket's full parameters are allocated (gathered, or arriving)."""
        return bucket.full.untyped_storage().nbytes() > 0

    def gather_params(self, bucket: Bucket) -> None:
        """ZeRO-3: start the asynchronous all-gather of the bucket's parameters from every
        replica's owned piece into the bucket's storage, allocated for it; a no-op when they are
        gathered or on their way. Every replica runs the same units in the same order, so the
        group's gathers are issued in one order (as NCCL needs)."""
        if self.is_gathered(bucket):
            return
        full = bucket.full
        full.untyped_storage().resize_(full.numel() * full.element_size())
        with self._from_host() as bring_up:
            source = bring_up(self.owned_params(bucket))
            handle = comm.all_gather_flat(full, source, self.shard_group, async_op=True)
        bucket.gather = (handle, source)

    @contextlib.contextmanager
    def _from_host(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """Where a gather is issued, and what brings its owned piece to the device: the compute
        stream and nothing, or under `offload_params` on CUDA the upload stream, after the
        work queued so far (which frees the memory the upload and the gather write), with a
        copy from pinned memory. NCCL orders the all-gather after its issuing stream, and
        `wait_param_gather` orders the compute after the gather. On the CPU host and device are
        one: the piece is its own source."""
        if self.upload_stream is None:
            yield lambda piece: piece
            return
        self.upload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.upload_stream):
            yield lambda piece: piece.to(self.device, non_blocking=True)

    def release_params(self, bucket: Bucket) -> None:
        """ZeRO-3: free the bucket's full parameters (once their gather has landed): its
        parameters keep their shapes, over an empty storage, until the next `gather_params`.
        Kernels queued on the stream that read them run before any later use of the memory."""
        self.wait_param_gather(bucket)
        bucket.full.untyped_storage().resize_(0)

    def wait_param_gather(self, bucket: Bucket) -> None:
        """Block until the bucket's parameters have arrived (a no-op when they have)."""
        if bucket.gather is not None:
            bucket.gather[0].wait()
            bucket.gather = None

    def finish_param_gather(self) -> None:
        """Wait for every bucket's parameters: before anything reads them all (evaluation, a
        checkpoint, the next update)."""
        for bucket in self.buckets:
            self.wait_param_gather(bucket)


def _add_wgrad(target: torch.Tensor, dy: torch.Tensor, x: torch.Tensor | None, first: bool) -> None:
    """target (+)= dy^T x in fp32; a bias (x None): dy summed over the tokens."""
    if x is None:
        if first:  # summed straight into the target: one kernel
            torch.sum(dy, 0, dtype=torch.float32, out=target)
        else:
            target.add_(dy.sum(0, dtype=torch.float32))
    else:
        wgrad_accumulate(target, dy, x, overwrite=first)


def _wait_for_parameters(pairs: list[tuple[GradBuffer, Bucket]], *_: Any) -> None:
    for buffer, bucket in pairs:
        buffer.wait_param_gather(bucket)


def _install_gather_waits(chunk: nn.Module, buffers: list[GradBuffer]) -> None:
    """A forward pre-hook on each module of `chunk` that owns parameters waits for their
    buckets' all-gathers, so a forward blocks only on the parameters it is about to use. A
    module without a forward of its own only holds parameters that its caller reads (MoE's
    expert weights): the nearest ancestor with a forward waits for them."""
    waits: dict[nn.Module, dict[int, tuple[GradBuffer, Bucket]]] = {}
    callers = {chunk: chunk}
    for name, module in chunk.named_modules():
        if module is not chunk:
            parent = chunk.get_submodule(name.rpartition(".")[0])
            callers[module] = module if has_forward(module) else callers[parent]
        for param in module.parameters(recurse=False):
            for buffer in buffers:
                if (bucket := buffer.bucket_of.get(param)) is not None:
                    waits.setdefault(callers[module], {})[id(bucket)] = (buffer, bucket)
    for module, pairs in waits.items():
        module.register_forward_pre_hook(
            functools.partial(_wait_for_parameters, list(pairs.values()))
        )


def build_grad_buffers(
    chunks: list[nn.Module],
    ps: ParallelState,
    bucket_mb: float,
    zero: int,
    own_bucket: set[nn.Parameter] = frozenset(),
    fuse_wgrad: bool = True,
    offload_params: bool = False,
    keep_gathered: bool = False,
) -> list[GradBuffer]:
    """One buffer per (model chunk, parameter dtype, replica axes: the experts apart), parameters
    in reverse (backward) order. `zero`: 0 (everything replicated), 1 (optimizer state sharded), 2
    (gradients too), 3 (parameters too, gathered unit by unit: `zero3`); `fuse_wgrad`,
    `offload_params`, `keep_gathered`: see `GradBuffer`'s fields."""
    buffers = []
    bucket_numel = max(1, int(bucket_mb * 2**20 / 4))
    for chunk in chunks:
        units = parameter_units(chunk) if zero == 3 else []
        units_of_params = unit_index(units)
        by_kind: dict[tuple[torch.dtype, tuple[str, ...]], list[nn.Parameter]] = {}
        for param in reversed(list(chunk.parameters())):
            replicas = param.meta.replica_axes(ps.dims)
            by_kind.setdefault((param.dtype, replicas), []).append(param)
        chunk_buffers = [
            GradBuffer(
                params,
                ps,
                bucket_numel,
                zero >= 1,
                set(own_bucket),
                zero >= 2,
                fuse_wgrad,
                chunk.ctx.deferral,
                shard_params=zero == 3,
                unit_of=units_of_params,
                offload_params=offload_params,
                keep_gathered=keep_gathered,
            )
            for params in by_kind.values()
        ]
        sharded_params = [buffer for buffer in chunk_buffers if buffer.params_sharded]
        if sharded_params:
            ShardedUnits(units, sharded_params, keep=keep_gathered)
        elif any(buffer.sharded for buffer in chunk_buffers):
            _install_gather_waits(chunk, chunk_buffers)
        buffers += chunk_buffers
    return buffers
