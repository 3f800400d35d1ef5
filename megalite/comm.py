"""The one place that calls torch.distributed collectives.

Every function takes the process group it works on; a group of None means a group of one rank,
where collectives are identities and nothing touches torch.distributed. That keeps the
single-process path free of any distributed setup.

Communication is watched one way: `CommObserver`s (comm_trace.py). Each is told of every call
as it is entered, while the rank is blocked in it, when an asynchronous one is issued, and
around the copies a dim-wise collective makes into the layout the backend needs. Always
registered: the watchdog's `progress` (which also names a call that fails: `CollectiveError`)
and the trace file the multi-process tests compare across ranks; for a while (`observe`): the
byte counts tests read (`record_collectives`) and the profiler's `CommTimer`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megalite import comm_trace
from megalite.comm_trace import CommObserver
from megalite.eager_boundary import eager_only

# torch >= 2.9 names these *_single; older releases only have the *_tensor spelling.
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass
class CollectiveRecord:
    op: str
    bytes: int
    """Bytes of the full (unsharded) tensor the collective works on."""
    group_size: int


class ByteCounter(CommObserver):
    """A CollectiveRecord for every collective and send (`record_collectives`)."""

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []

    def entered(self, call: comm_trace.Call) -> None:
        if call.dtype is None or call.op == "recv":
            return
        group_size = 1 if call.peer is not None else size(call.group)
        nbytes = call.numel * call.dtype.itemsize
        self.records.append(CollectiveRecord(call.op, nbytes, group_size))


_observers: list[CommObserver] = [comm_trace.progress, comm_trace.trace_file]
"""Every observer of this process's communication: the always-on ones first (`progress`
outermost, so it names any call that fails), then those `observe` registers."""


def _watches_blocking(observer: CommObserver) -> bool:
    return type(observer).blocking is not CommObserver.blocking


_watchers = [observer for observer in _observers if _watches_blocking(observer)]
"""The observers of `_observers` that watch the rank blocked (`CommObserver.blocking`), in the
same order. Only these are entered around every call: a collective's own Python cost is paid
for every micro-batch, and a GPU's host must keep ahead of its kernels."""


@contextlib.contextmanager
def observe(observer: CommObserver) -> Iterator[CommObserver]:
    """Register `observer` inside the block."""
    watches = _watches_blocking(observer)
    _observers.append(observer)
    if watches:
        _watchers.append(observer)
    try:
        yield observer
    finally:
        _observers.remove(observer)
        if watches:
            _watchers.remove(observer)


@contextlib.contextmanager
def record_collectives() -> Iterator[list[CollectiveRecord]]:
    """Collect a CollectiveRecord for every collective issued inside the block."""
    with observe(ByteCounter()) as counter:
        yield counter.records


def _enter(op: str, tensor: torch.Tensor | None, group: Any, peer: int | None = None):
    """The record of a call about to be issued, shown to every observer."""
    call = comm_trace.new_call(op, tensor, group, peer)
    for observer in _observers:
        observer.entered(call)
    return call


def _blocking(call: comm_trace.Call) -> contextlib.AbstractContextManager[None]:
    """The rank is blocked in `call`: every watcher knows (the watchdog's progress first)."""
    if len(_watchers) == 1:  # progress alone: outside profiling and tests
        return _watchers[0].blocking(call)
    return _all_blocking(call)


@contextlib.contextmanager
def _all_blocking(call: comm_trace.Call) -> Iterator[None]:
    with contextlib.ExitStack() as observed:
        for observer in _watchers:
            observed.enter_context(observer.blocking(call))
        yield


class _Tracked:
    """The handle of an asynchronous call: its wait is watched like a blocking call; everything
    else (is_completed, get_future) is the backend's own handle's."""

    def __init__(self, work: Any, call: comm_trace.Call) -> None:
        self.work, self.call = work, call

    def wait(self) -> bool:
        with _blocking(self.call):
            return self.work.wait()

    def __getattr__(self, name: str) -> Any:
        if name == "work":  # not set yet (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.work, name)


class Emulation(Protocol):
    """What a test puts between comm and a gloo backend (`megalite.testing.nccl_like`), so
    that gloo runs the trainer's communication as NCCL would."""

    def applies(self, group: Any) -> bool: ...
    def issue(self, call: comm_trace.Call, issue: Callable[[bool], Any], async_op: bool) -> Any: ...
    def batch_isend_irecv(self, ops: list[dist.P2POp], call: comm_trace.Call) -> list[Any]: ...


_emulation: Emulation | None = None
"""The test mode's emulation, or None: the backend as it is (every run outside the tests)."""


def set_emulation(emulation: Emulation | None) -> None:
    """Run every later call on a group the emulation `applies` to through it (None: none)."""
    global _emulation
    _emulation = emulation


def _emulates(group: Any) -> bool:
    return _emulation is not None and _emulation.applies(group)


def _issue(call: comm_trace.Call, issue: Callable[[bool], Any], async_op: bool) -> Any:
    """Run `issue(async_op)`: watched while it blocks, or its handle tracked when asynchronous."""
    with _blocking(call):
        if _emulates(call.group):
            work = _emulation.issue(call, issue, async_op)
        else:
            work = issue(async_op)
    if not async_op:
        return work
    for observer in _observers:
        observer.started(call, work)
    return _Tracked(work, call)


def size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def _require_contiguous(op: str, tensors: list[torch.Tensor]) -> None:
    """Refuse a strided tensor whatever the backend: NCCL refuses it, or sends its raw memory,
    where gloo may quietly reduce the wrong elements (`nccl_contract`, item 6)."""
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError(
                f"{op} of a non-contiguous tensor {tuple(tensor.shape)} (strides "
                f"{tensor.stride()}): pass .contiguous(), and copy the result back if needed"
            )


def all_reduce(tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """Sum `tensor` in place over the group."""
    if size(group) == 1:
        return None
    _require_contiguous("all_reduce", [tensor])
    call = _enter("all_reduce", tensor, group)
    return _issue(call, lambda a: dist.all_reduce(tensor, group=group, async_op=a), async_op)


def all_reduce_max(tensor: torch.Tensor, group: Any) -> None:
    if size(group) > 1:
        _require_contiguous("all_reduce_max", [tensor])
        call = _enter("all_reduce_max", tensor, group)
        maximum = dist.ReduceOp.MAX
        _issue(call, lambda a: dist.all_reduce(tensor, maximum, group, async_op=a), False)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: Any, async_op=False) -> Any:
    """Concatenate every rank's 1-D `shard` into `output` (size group * shard)."""
    if size(group) == 1:
        output.copy_(shard)
        return None
    return _all_gather_joined(output, [shard], group, async_op)


def _all_gather_joined(
    output: torch.Tensor, sources: list[torch.Tensor], group: Any, async_op: bool
) -> Any:
    """Every rank's 1-D `sources`, concatenated, into `output` (group * their total), rank by
    rank; on gloo the sources are written straight into the all-to-all's send buffer."""
    call = _enter("all_gather", output, group)
    if _on_gloo_cpu(output, group):
        pieces = output.view(size(group), -1)
        return _issue(call, _gloo_all_gather(pieces, sources, group), async_op)
    send = sources[0] if len(sources) == 1 else torch.cat(sources)
    return _issue(call, lambda a: _all_gather_flat(output, send, group=group, async_op=a), async_op)


def _on_gloo_cpu(tensor: torch.Tensor, group: Any) -> bool:
    """Whether `group` is a gloo group working on CPU tensors, where the all-gather and the
    reduce-scatter are faster as all-to-alls (`_gloo_all_gather`, `_gloo_reduce_scatter`)."""
    return tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


class _FinishedOnWait:
    """An asynchronous call whose result needs local work once it has arrived: `wait()` waits,
    then runs `finish`; everything else is the backend's own handle's."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self.work, self.finish = work, finish

    def wait(self) -> bool:
        self.work.wait()
        self.finish()
        return True

    def __getattr__(self, name: str) -> Any:
        if name == "work":
            raise AttributeError(name)
        return getattr(self.work, name)


def _all_to_all(
    output: torch.Tensor, source: torch.Tensor, group: Any, finish: Callable[[], None] | None
) -> Callable[[bool], Any]:
    """Issue an all-to-all of equal pieces (flat `source` to flat `output`); `finish` runs once
    it has arrived."""

    def issue(async_op: bool) -> Any:
        work = dist.all_to_all_single(output, source, group=group, async_op=async_op)
        if finish is None:
            return work
        if async_op:
            return _FinishedOnWait(work, finish)
        finish()
        return None

    return issue


def _gloo_all_gather(pieces: torch.Tensor, sources: list[torch.Tensor], group: Any) -> Callable:
    """An all-gather on gloo as an all-to-all that sends every rank a copy of the (concatenated
    1-D) sources, into `pieces` (world, their total). Why: gloo's allgather took 0.9-1.3 ms
    where the all-to-all of the same bytes took 0.6-0.7 (2 ranks, 512 KiB out); point-to-point
    messages were faster alone but cost 2-3x the system time inside a training step."""
    send = torch.cat(sources * size(group))  # piece r, what rank r receives: the sources joined
    return _all_to_all(pieces.view(-1), send, group, None)


def reduce_scatter_flat(
    shard: torch.Tensor, full: torch.Tensor, group: Any, async_op: bool = False
) -> Any:
    """Sum 1-D `full` over the group and keep this rank's contiguous piece in `shard`."""
    if size(group) == 1:
        shard.copy_(full)
        return None
    return _reduce_scatter(shard, full.view(size(group), -1), group, async_op)


def _reduce_scatter(shard: torch.Tensor, pieces: torch.Tensor, group: Any, async_op: bool) -> Any:
    """Sum `pieces` (world, *shard.shape; row r goes to group rank r, any strides) over the
    group into `shard`."""
    call = _enter("reduce_scatter", pieces, group)
    if _on_gloo_cpu(pieces, group):
        return _issue(call, _gloo_reduce_scatter(shard, pieces, group), async_op)
    full = _observed_contiguous(pieces)
    flat = shard.view(-1)
    return _issue(
        call, lambda a: _reduce_scatter_flat(flat, full.view(-1), group=group, async_op=a), async_op
    )


def _gloo_reduce_scatter(shard: torch.Tensor, pieces: torch.Tensor, group: Any) -> Callable:
    """A reduce-scatter on gloo as an all-to-all (each rank receives every rank's copy of its
    own piece) and a local sum. Why: ProcessGroupGloo's reduce_scatter_tensor clones the input,
    all-reduces all of it and copies this rank's piece out (torch 2.13, ProcessGroupGloo.cpp),
    twice the bytes of a reduce-scatter and two extra copies; on CPU that made every
    sequence-parallel reduce-scatter cost more than the all-reduce it replaces. The all-to-all
    moves (world - 1) / world of the tensor, the least a reduce-scatter can."""
    received = shard.new_empty(pieces.shape)  # row r: rank r's copy of this rank's piece
    full = _observed_contiguous(pieces)
    return _all_to_all(received.view(-1), full.view(-1), group, lambda: _sum(received, shard))


def _sum(pieces: list[torch.Tensor] | torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The sum of `pieces` (two or more) into `out`, in their order: pairwise adds, a third of
    the time of torch.sum over dim 0 (2 ranks, 512 KiB)."""
    torch.add(pieces[0], pieces[1], out=out)
    for piece in pieces[2:]:
        out.add_(piece)
    return out


def reduce_scatter_own_last(
    others: torch.Tensor, own: Callable[[], torch.Tensor], group: Any
) -> torch.Tensor:
    """A reduce-scatter whose local piece is computed while the others travel: `others` holds
    this rank's partial sums of the other ranks' pieces (world - 1 equal blocks along dim 0,
    in rank order), which are sent at once; `own()` then computes this rank's partial sum of
    its own piece, and the result is that piece summed over the group, in rank order (as
    `reduce_scatter`'s). The exchange hides under `own()` (Wang et al. 2023), and moves
    (world - 1) / world of the tensor, as any reduce-scatter does. One all-to-all on every
    backend, this rank's own rows left out of it."""
    world, me = size(group), rank(group)
    piece = others.shape[0] // (world - 1)
    rows = [0 if r == me else piece for r in range(world)]
    received = torch.empty_like(others)  # block i: the i-th other rank's sum of this rank's piece
    # traced as a reduce-scatter of the whole tensor, as `reduce_scatter` is
    whole = torch.empty((world * piece, *others.shape[1:]), dtype=others.dtype, device="meta")
    call = _enter("reduce_scatter", whole, group)

    def issue(async_op: bool) -> Any:
        return dist.all_to_all_single(received, others, rows, rows, group=group, async_op=async_op)

    exchange = _issue(call, issue, True)
    mine = own()
    exchange.wait()
    pieces = list(received.split(piece))
    pieces.insert(me, mine)
    # the first add may write over `mine` only where `mine` is one of its two terms
    return _sum(pieces, mine if me < 2 else torch.empty_like(mine))


def _observed_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous; a copy (when it is strided) is shown to the observers as a layout
    copy: what a dim-wise collective on (b, s, h) pays that (s, b, h) would not."""
    if tensor.is_contiguous():
        return tensor
    with contextlib.ExitStack() as observed:
        for observer in _observers:
            observed.enter_context(observer.layout_copy())
        return tensor.contiguous()


class Pending:
    """A dim-wise all-gather or reduce-scatter in flight: `wait()` returns its result. The
    backward of a column-parallel linear starts one, computes a GEMM, then waits."""

    def __init__(self, handle: Any, result: Callable[[], Any]) -> None:
        self.handle, self.result = handle, result

    def wait(self) -> Any:
        if self.handle is not None:
            self.handle.wait()
        return self.result()


def all_gather_start(tensor: torch.Tensor, group: Any, dim: int) -> Pending:
    """Start concatenating every rank's `tensor` along `dim`; the result is contiguous (a
    strided view would make every reader keep a contiguous copy of its own). The shards arrive
    one per row (world, *shape) and are joined along `dim`: free on dim 0 (or behind dims of
    size 1), else one copy."""
    world = size(group)
    if world == 1:
        return Pending(None, lambda: tensor)
    dim %= tensor.dim()
    shard = tensor.contiguous()
    pieces = shard.new_empty((world, *shard.shape))
    handle = all_gather_flat(pieces.view(-1), shard.view(-1), group, async_op=True)
    return Pending(handle, lambda: _joined(pieces, dim))


def all_gather(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` (contiguous)."""
    return all_gather_start(tensor, group, dim).wait()


def all_gather_together_start(tensors: list[torch.Tensor], group: Any, dim: int) -> Pending:
    """Start `all_gather(t, group, dim)` of each tensor (one dtype) as one collective: one call
    instead of several pays the collective's fixed cost once (sequence parallelism's backward,
    `linear.py`). `wait()` returns the list of results."""
    world = size(group)
    if world == 1:
        return Pending(None, lambda: list(tensors))
    dim %= tensors[0].dim()
    sizes = [t.numel() for t in tensors]
    output = tensors[0].new_empty((world, sum(sizes)))
    sources = [t.reshape(-1) for t in tensors]
    handle = _all_gather_joined(output.view(-1), sources, group, async_op=True)

    def results() -> list[torch.Tensor]:
        blocks = zip(output.split(sizes, dim=1), tensors)
        return [_joined(block.unflatten(1, t.shape), dim) for block, t in blocks]

    return Pending(handle, results)


def _joined(pieces: torch.Tensor, dim: int) -> torch.Tensor:
    """`pieces` (world, *shape: rank r's tensor in row r) concatenated along `dim`, contiguous.
    A copy where dims before `dim` hold more than one element is a layout copy, shown to the
    observers ((s, b, h) would not need it); otherwise a copy is made only if the rows are not
    already one block of memory (a coalesced gather's), and observed as nothing."""
    moved = pieces.movedim(0, dim)
    layout = math.prod(moved.shape[:dim]) > 1
    joined = _observed_contiguous(moved) if layout else moved.contiguous()
    return joined.flatten(dim, dim + 1)


def reduce_scatter_start(tensor: torch.Tensor, group: Any, dim: int) -> Pending:
    """Start summing `tensor` over the group; the result is this rank's equal piece along
    `dim`, contiguous."""
    world = size(group)
    if world == 1:
        return Pending(None, lambda: tensor)
    dim %= tensor.dim()
    if tensor.shape[dim] % world:
        raise ValueError(f"dim {dim} of size {tensor.shape[dim]} does not split over {world} ranks")
    pieces = tensor.unflatten(dim, (world, -1)).movedim(dim, 0)  # row r: rank r's piece
    output = tensor.new_empty(pieces.shape[1:])
    handle = _reduce_scatter(output, pieces, group, async_op=True)
    return Pending(handle, lambda: output)


def reduce_scatter(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Sum `tensor` over the group and return this rank's equal piece along `dim`."""
    return reduce_scatter_start(tensor, group, dim).wait()


def all_to_all(
    tensor: torch.Tensor, group: Any, send_rows: list[int], receive_rows: list[int]
) -> torch.Tensor:
    """Send the i-th block of `send_rows[i]` rows of `tensor` (dim 0) to group rank i, and
    return the blocks received, `receive_rows[i]` rows from rank i, in rank order (the
    experts' token exchange). Row counts may differ per rank and be zero."""
    if size(group) == 1:
        return tensor
    tensor = tensor.contiguous()
    output = tensor.new_empty((sum(receive_rows), *tensor.shape[1:]))
    # Traced by one row: the row counts differ over ranks by design (they are what an equal-size
    # exchange before it agreed on), the row's shape and dtype may not.
    row = torch.empty((1, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
    call = _enter("all_to_all", row, group)

    def issue(async_op: bool) -> Any:
        return dist.all_to_all_single(
            output, tensor, receive_rows, send_rows, group=group, async_op=async_op
        )

    _issue(call, issue, False)
    return output


def split(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """This rank's equal piece of `tensor` along `dim` (no communication)."""
    world = size(group)
    if world == 1:
        return tensor
    if tensor.shape[dim] % world:
        raise ValueError(f"dim {dim} of size {tensor.shape[dim]} does not split over {world} ranks")
    return tensor.chunk(world, dim=dim)[rank(group)].contiguous()


class P2PBatch:
    """The handle of one posted batch of sends and receives: done when every work the backend
    returned for it is (one per op on gloo, one for the whole batch on NCCL: `nccl_contract`,
    item 1), so a batch's receives are ready only once all of them have completed. Each work is
    waited for once (gloo hangs on a second wait)."""

    def __init__(self, works: list[Any], call: comm_trace.Call) -> None:
        self.works, self.call = works, call

    def wait(self) -> None:
        with _blocking(self.call):
            while self.works:
                self.works[-1].wait()
                self.works.pop()

    def is_completed(self) -> bool:
        self.works = [work for work in self.works if not work.is_completed()]
        return not self.works


def post_p2p(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Any
) -> P2PBatch | None:
    """Start point-to-point sends and receives (tensor, global peer rank) over `group` as one
    batch and return its handle (None for an empty batch).

    The batch goes on `group`'s own communicator (each op names its peer by its rank in the
    group, `group_peer`): a `P2POp` without a group would go on the world's, where NCCL would
    queue it behind every other purpose's traffic (`nccl_contract`, item 10). NCCL runs a
    group's batches one after another on one stream, and a send completes only when the
    receiver's stream reaches the matching receive; gloo runs a rank's batches side by side, so
    a batching that deadlocks on GPUs runs here. Under the test mode's emulation
    (`megalite.testing.nccl_like`) the batch behaves and returns as NCCL's does.
    """
    _require_contiguous("p2p", [t for t, _ in sends + recvs])
    calls = [_enter("send", t, group, peer) for t, peer in sends]
    calls += [_enter("recv", t, group, peer) for t, peer in recvs]
    if not calls:
        return None
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=_peer(group, p)) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=_peer(group, p)) for t, p in recvs]
    with _blocking(calls[-1]):
        if _emulates(group):
            works = _emulation.batch_isend_irecv(ops, calls[-1])
        else:
            works = dist.batch_isend_irecv(ops)
    return P2PBatch(list(works), calls[-1])


def _peer(group: Any, global_rank: int) -> int:
    """`global_rank`'s rank within `group`."""
    return dist.get_group_rank(group, global_rank)


def any_rank(flag: bool) -> bool:
    """Collective over the world, and a barrier: whether `flag` holds on any rank (one rank's
    failure stops every rank alike, where a barrier would leave them waiting for it)."""
    if not dist.is_initialized():
        return flag
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    found = torch.tensor([float(flag)], device=device)
    all_reduce_max(found, dist.group.WORLD)
    return bool(found.item())


def barrier(group: Any = None) -> None:
    if dist.is_initialized():
        call = _enter("barrier", None, group)
        _issue(call, lambda a: dist.barrier(group=group, async_op=a), False)


@eager_only  # a compiled region calls it as one opaque op: its graphs hold no collective
def all_reduce_eagerly(tensor: torch.Tensor, *groups: Any) -> torch.Tensor:
    """`tensor` summed in place over each of `groups` in turn (`all_reduce`), run eagerly even
    from inside a compiled block (the MoE's routing counts), so that every observer sees the
    calls and no graph captures a collective."""
    for group in groups:
        all_reduce(tensor, group)
    return tensor
