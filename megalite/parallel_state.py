"""Who talks to whom: the process groups of the rank grid, and this rank's place in it.

The grid itself (axis order, sizes, coordinates, which ranks form each group) is
`parallel_dims.ParallelDims`, pure and testable without processes; `ParallelState` is built
once from it and passed to whatever needs a group. Nothing else in megalite creates process
groups.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megalite.errors import ConfigError, MegaliteError
from megalite.parallel_dims import ORDER, ParallelDims


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the grid and the groups it belongs to (None when of size 1). Built
    without groups (`ParallelState(dims, rank, device)`) it describes a rank for code that
    needs no collective: estimates, tests.

    A group is asked for by the axes it spans, in either view of the grid (`ParallelDims.views`):
    `group("tp")`, `group("cp", "dp")` (the replicas of the dense weights: gradients are summed,
    ZeRO shards, over them), `group("ep")` (the experts' all-to-all), `group("cp", "edp")` (the
    replicas of one expert's weights). `size` and `coord` answer for the same axes."""

    dims: ParallelDims
    rank: int
    device: torch.device
    groups: dict[str, Any] = field(default_factory=dict)
    """This rank's process group of each of `dims.named_groups()`; absent or None where it
    would have one rank."""
    world_group: Any = None

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def size(self, *axes: str) -> int:
        """How many ranks the group of `axes` has."""
        return math.prod(self.dims.view_of(axes).sizes[axis] for axis in axes)

    def coord(self, *axes: str) -> int:
        """This rank's place in its group of `axes`, the grid's faster axes varying fastest
        (`coord("cp", "dp")` is dp_rank * cp + cp_rank): for one axis, its coordinate."""
        view = self.dims.view_of(axes)
        coords, place, stride = view.coords(self.rank), 0, 1
        for axis in (a for a in view.sizes if a in axes):
            place, stride = place + coords[axis] * stride, stride * view.sizes[axis]
        return place

    def group(self, *axes: str) -> Any:
        """This rank's process group spanning `axes` (None: a group of one rank)."""
        if self.size(*axes) == 1:
            return None
        return self.groups.get(self.dims.group_name(axes))

    def ranks(self, *axes: str) -> tuple[int, ...]:
        """Global ranks of this rank's group of `axes`, indexed by `coord` (for p2p)."""
        return tuple(self.dims.view_of(axes).group_of(self.rank, *axes))

    @property
    def embedding_group(self) -> Any:
        """The first and last pipeline stage: two ranks of pp, not a group of any axis."""
        return self.groups.get("embedding")

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """The trivial layout: one process, no groups, no torch.distributed."""
        return cls(ParallelDims.for_world(1), 0, torch.device(device))


def choose_device(requested: str = "auto") -> torch.device:
    """CUDA when present (or asked for), else CPU; the code path is the same. The kernels that
    `MEGALITE_KERNELS` asks for must run there: a value they refuse is bad input, stopped here
    with the kernels' own message (one `error:` line, exit code 2), not mid-step."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but CUDA is not available: use auto or cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_gpu(local_rank, torch.cuda.device_count()))
    else:
        device = torch.device("cpu")
    from megalite.kernels import kernel_backend  # imports Triton: only where a run starts

    try:  # no tensor for CUDA, which the kernels then assume: nothing allocated before set_device
        kernel_backend(*([] if device.type == "cuda" else [torch.empty(0)]))
    except (ValueError, RuntimeError) as refused:
        raise ConfigError(str(refused)) from None
    return device


LAUNCH_ORDER_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def keep_launch_order(tp: int) -> None:
    """Under tensor parallelism, give each GPU one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1)
    before this process starts CUDA, as Megatron-LM requires.

    Why: an overlapped TP or SP GEMM (`tensor_parallel.linear`) issues its collective and then
    the GEMM meant to hide it. With several queues the GPU may start the GEMM first, fill every
    SM, and the collective's kernel waits for it: the overlap is gone. With one, kernels start
    in the order they were launched. Another value already set is refused (it would silently
    undo the overlap), and so is a process whose CUDA has started (the driver reads the
    variable once, when it makes the context)."""
    if tp == 1:
        return
    value = os.environ.get(LAUNCH_ORDER_ENV)
    if value not in (None, "1"):
        raise ConfigError(
            f"{LAUNCH_ORDER_ENV}={value} with parallel.tp={tp}: tensor parallelism overlaps its "
            f"collectives with GEMMs only when kernels start in launch order; unset it or set "
            f"{LAUNCH_ORDER_ENV}=1"
        )
    if value is None and torch.cuda.is_initialized():
        raise MegaliteError(
            f"CUDA started before megalite could set {LAUNCH_ORDER_ENV}=1 for parallel.tp={tp}: "
            "export it before starting the process"
        )
    os.environ[LAUNCH_ORDER_ENV] = "1"


def local_gpu(local_rank: int, visible: int) -> int:
    """The index of this rank's GPU among the `visible` ones this process sees.

    Why not always LOCAL_RANK: launchers that give each rank a GPU of its own
    (CUDA_VISIBLE_DEVICES per rank, as some Slurm setups do) leave one visible device, cuda:0,
    whatever the rank's LOCAL_RANK. A process that sees several takes the LOCAL_RANK-th."""
    if visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    raise MegaliteError(
        f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs: start at most {visible} "
        "ranks per node, or give each rank one GPU with CUDA_VISIBLE_DEVICES"
    )


class DistributedStartError(MegaliteError):
    """The ranks could not form their process groups in time (a rank missing or unreachable)."""


GENERATION_KEY = "megalite/generation"
"""Agent-store counter: one generation per start of the worker group (first start, restarts)."""


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the torchrun world; nccl on CUDA, gloo on CPU. Under torchrun's agent every start
    of the workers (the first, and each restart) rendezvouses in a key space of its own
    (`elastic_store`), so a restarted worker never reads a dead worker's address.

    On CUDA the device is bound (`device_id`): NCCL connects the world now, so a missing or
    broken rank fails here rather than in step 1, and the groups `build_parallel_state` makes
    are split from this communicator instead of each bootstrapping through the store.

    A single process without torchrun variables stays out of torch.distributed entirely.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return 0, 1
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank = int(os.environ["RANK"])
    timeout = datetime.timedelta(seconds=timeout_s)
    store = elastic_store(rank, world_size, timeout_s)
    kwargs = {} if store is None else {"store": store, "rank": rank, "world_size": world_size}
    if device.type == "cuda":
        kwargs["device_id"] = device
    with _starting("joining the world", timeout_s):
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout, **kwargs
        )
    return dist.get_rank(), dist.get_world_size()


def elastic_store(rank: int, world_size: int, timeout_s: float) -> dist.Store | None:
    """The store this start of the workers rendezvouses in, or None outside torchrun's agent.

    Why: torchrun's agent hosts one TCPStore for the whole job and hands the same
    MASTER_ADDR/PORT to every restart, and torch's env:// rendezvous adds no per-restart prefix.
    Restarted workers then find the keys of the workers they replace: gloo connects to the
    dead ranks' published addresses ("connectFullMesh failed ... Connection refused") and
    group barriers count arrivals from before the crash (hangs in `new_group`). A fresh key
    prefix per generation removes both. The restart count cannot name the generation across
    nodes (an agent that restarts because another node failed does not count it), so the
    ranks agree on one through the store (`agree_on_generation`)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    with _starting("connecting to the rendezvous store", timeout_s):
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    generation = agree_on_generation(base, rank, world_size, timeout_s)
    return dist.PrefixStore(f"megalite/generation{generation}/", base)


def agree_on_generation(
    store: dist.Store, rank: int, world_size: int, timeout_s: float, max_poll_s: float = 2.0
) -> int:
    """A generation number that all `world_size` ranks of this start share and no earlier start
    used, agreed through `store` even though it holds the keys of earlier starts.

    Rank 0 draws the next number from a counter. Another rank cannot tell whether the counter
    it reads is already this start's, so it greets that generation with a fresh nonce and
    takes it only when rank 0 answers that very nonce; a stale generation is never answered
    (its rank 0 is gone) and the rank reads again, backing off up to `max_poll_s`. Earlier
    workers are all stopped before the agents rendezvous again, so only this start's ranks
    greet the new generation."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        generation = store.add(GENERATION_KEY, 1)
        greetings = [f"{GENERATION_KEY}{generation}/hello/{r}" for r in range(1, world_size)]
        with _starting(f"waiting for {world_size - 1} other ranks", timeout_s):
            store.wait(greetings, datetime.timedelta(seconds=timeout_s))
        for r, key in enumerate(greetings, start=1):
            nonce = store.get(key).decode()
            store.set(f"{GENERATION_KEY}{generation}/welcome/{r}/{nonce}", "1")
        return generation
    nonce, poll_s = uuid.uuid4().hex, 0.05
    while time.monotonic() < deadline:
        generation = store.add(GENERATION_KEY, 0)
        if generation > 0:
            store.set(f"{GENERATION_KEY}{generation}/hello/{rank}", nonce)
            welcome = f"{GENERATION_KEY}{generation}/welcome/{rank}/{nonce}"
            try:
                store.wait([welcome], datetime.timedelta(seconds=poll_s))
                return generation
            except dist.DistStoreError:
                pass  # a generation of an earlier start, or rank 0 not answering yet
        else:
            time.sleep(poll_s)
        poll_s = min(2 * poll_s, max_poll_s)
    raise DistributedStartError(
        f"rank {rank} found no rank 0 to start with in {timeout_s:.0f}s (rendezvous store "
        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}): check that every "
        "node runs the same torchrun command and can reach the first node"
    )


@contextlib.contextmanager
def _starting(what: str, timeout_s: float | None = None) -> Iterator[None]:
    """Turn a failure or time-out of process-group start-up into one clear error (each step is
    bounded by the time-out init_distributed was given)."""
    try:
        yield
    except (RuntimeError, ValueError) as failure:  # DistError, DistStoreError, gloo's errors
        rank = os.environ.get("RANK", "?")
        limit = f" (time-out {timeout_s:.0f}s)" if timeout_s is not None else ""
        raise DistributedStartError(
            f"rank {rank} failed {what}{limit}: "
            f"{str(failure).splitlines()[0] if str(failure) else type(failure).__name__}. A "
            "rank is missing, crashed while starting, or cannot reach the others"
        ) from failure


def build_parallel_state(
    tp: int,
    pp: int,
    device: torch.device,
    timeout_s: float | None = None,
    cp: int = 1,
    ep: int = 1,
    dp_replicate: int = 1,
) -> ParallelState:
    """Create every process group of the layout; must run on all ranks in the same order.

    Every group times out after `timeout_s` (None: the world group's, which init_distributed
    set from fault.collective_timeout_s), where torch would give the backend's default (NCCL:
    10 minutes). A group that spans the world is a communicator of its own all the same (the
    world group carries the run's control traffic: verdicts, metrics, checkpoint tokens).
    A single process outside torch.distributed gets the layout of one rank, or the error that
    says how many processes the layout needs."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.for_world(world_size, ep=ep, dp_replicate=dp_replicate, tp=tp, cp=cp, pp=pp)
    if not dist.is_initialized():
        return ParallelState(dims, 0, device)
    rank = dist.get_rank()
    if timeout_s is None:
        timeout = group_timeout(dist.group.WORLD, device)
    else:
        timeout = datetime.timedelta(seconds=timeout_s)
    with _starting("creating the process groups", timeout.total_seconds()):
        groups = create_groups(dims, rank, timeout)
    return ParallelState(dims, rank, device, groups, world_group=dist.group.WORLD)


def create_groups(dims: ParallelDims, rank: int, timeout: datetime.timedelta) -> dict[str, Any]:
    """This rank's group of each of the grid's named groups: one communicator per purpose.

    None where the name's groups have one rank (comm treats None as a group of one: nothing
    to create, no communicator to hold). Every other name gets groups of its own, even where
    its ranks are another name's or the whole world's: NCCL runs one group's work in issue
    order on one stream (`nccl_contract`, item 10), so a ring step on a group it shared with the
    ZeRO gathers, or an all-to-all on the world's, would wait behind traffic it does not need.
    Every rank takes the same decisions, from the grid alone, so each creating call is made on
    every rank."""
    mine: dict[str, Any] = {}
    for name, groups in dims.named_groups().items():
        several = [tuple(g) for g in groups if len(g) > 1]
        made = _create_axis(name, several, rank, timeout) if several else []
        mine[name] = next((m for g, m in zip(several, made) if rank in g), None)
    return mine


def _create_axis(
    axis: str, groups: list[tuple[int, ...]], rank: int, timeout: datetime.timedelta
) -> list[Any]:
    """The process groups of one axis (disjoint rank lists): this rank's, None for the others.

    With a bound device (NCCL, init_distributed's `device_id`) a group is split from the world
    communicator (ncclCommSplit), a call every world rank must enter: `new_group` makes each
    non-member take part in a no-colour split, one world-wide split per group (464 per rank at
    1,024 ranks, tp 8 x pp 8); `split_group` splits a whole axis in one. With
    `use_local_synchronization` the non-members would skip their part and the members hang.

    Without one (gloo; NCCL unbound) `split_group` refuses, and `new_group` returns at once on a
    non-member (no store traffic unless TORCH_DIST_INIT_BARRIER=1): microseconds. Local
    synchronization is not worth it there either: torch then names a group by a hash of its
    ranks and of how many groups the process holds, which members that made different numbers
    of groups (a second layout in one process; middle stages, in no embedding pair) disagree
    on, and gloo waits for store keys no peer writes."""
    ranks = [list(g) for g in groups]
    if dist.group.WORLD.bound_device_id is None:
        return [dist.new_group(r, timeout=timeout, group_desc=axis) for r in ranks]
    split = dist.split_group(split_ranks=ranks, timeout=timeout, group_desc=axis)
    return [split if rank in r else None for r in ranks]


def group_timeout(group: Any, device: torch.device) -> datetime.timedelta:
    """The time-out `group`'s backend for `device` gives its collectives."""
    options = group._get_backend(device).options
    if options is None:  # torch's fake backend keeps none
        raise MegaliteError(
            f"the {dist.get_backend(group)} backend does not say its time-out: pass timeout_s"
        )
    return options._timeout


@contextlib.contextmanager
def node_presence(ps: ParallelState) -> Iterator[None]:
    """The first process of every node says when its node joins the run and when, and how, it
    leaves, so that each node's console shows its part (only global rank 0 shows progress)."""
    speaks = ps.world_size > 1 and int(os.environ.get("LOCAL_RANK", 0)) == 0
    node = f"node {os.environ.get('GROUP_RANK', 0)} ({socket.gethostname()})"
    if speaks:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(
            f"{node} joined: {local} local ranks, global ranks {ps.rank}-{ps.rank + local - 1} "
            f"of {ps.world_size} (restart {restart})",
            flush=True,
        )
    how = "finished"
    try:
        yield
    except SystemExit as stop:  # a clean stop, e.g. preemption (its own code says which)
        how = f"exited with code {stop.code}"
        raise
    except BaseException as failure:
        text = str(failure).splitlines()[0] if str(failure) else ""
        how = f"failed: {type(failure).__name__}" + (f": {text}" if text else "")
        raise
    finally:
        if speaks:
            print(f"{node} left: {how}", flush=True)


def layout_change(
    saved: dict[str, int], ps: ParallelState, saved_batch: tuple[int, int], batch: tuple[int, int]
) -> str | None:
    """What changed between the layout a checkpoint was saved in (`ParallelDims.layout`) and
    this run's, in one line, or None when nothing did. `saved_batch` and `batch` are the
    (global, micro) batch sizes then and now: the global batch usually stays, and a smaller
    data-parallel world accumulates over more micro-batches per step, a larger one over fewer."""
    now = ps.dims.layout()
    if saved == now:
        return None

    def describe(layout: dict[str, int]) -> str:
        return " ".join(f"{axis} {size}" for axis, size in layout.items())

    (global_then, micro_then), (global_now, micro_now) = saved_batch, batch
    microbatches_then = global_then // (micro_then * saved["dp"])
    microbatches_now = global_now // (micro_now * ps.size("dp"))
    if global_then == global_now:
        global_batch = f"the same global batch of {global_now}"
    else:
        global_batch = f"a global batch of {global_then} -> {global_now}"
    then = "" if micro_then == micro_now else f" micro-batches of {micro_then}"
    world_then = math.prod(saved.get(axis, 1) for axis in ORDER)  # not ep: a view of dp
    return (
        f"world size {world_then} -> {ps.world_size}: layout {describe(saved)} "
        f"-> {describe(now)}, {global_batch} as {microbatches_then}{then} -> "
        f"{microbatches_now} micro-batches of {micro_now} per data-parallel rank"
    )
