"""Who talks to whom: the rank grid and the process groups built from it.

Ranks are laid out as in Megatron-LM: tp varies fastest (keep it inside a node), then dp, then
pp: `rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank`. `rank_grid` is pure so the layout is
testable without processes; `ParallelState` is built once and passed to whatever needs a group.
Nothing else in megalite creates process groups.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megalite.config import data_parallel_size
from megalite.errors import MegaliteError


@dataclass(frozen=True)
class RankGrid:
    """Every group of the layout as lists of global ranks (the same on every rank)."""

    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    pp_groups: list[list[int]]
    model_parallel_groups: list[list[int]]
    """tp x pp ranks that together hold one copy of the model (one per dp rank)."""
    embedding_groups: list[list[int]]
    """First and last pipeline stage of each pipeline: they share tied embeddings."""

    def by_axis(self) -> dict[str, list[list[int]]]:
        """Each axis's groups, keyed as ParallelState names them (`{axis}_group`), in the order
        they are created: the partitions of the world first, the embedding pairs last."""
        return {
            "tp": self.tp_groups,
            "dp": self.dp_groups,
            "pp": self.pp_groups,
            "model_parallel": self.model_parallel_groups,
            "embedding": self.embedding_groups,
        }


def rank_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    return pp_rank * (dp * tp) + dp_rank * tp + tp_rank


def rank_grid(world_size: int, tp: int, pp: int) -> RankGrid:
    """All groups for a world of `world_size` ranks split as tp x dp x pp."""
    dp = data_parallel_size(world_size, tp, pp)

    def ranks(tp_ranks, dp_ranks, pp_ranks) -> list[int]:
        return [rank_of(t, d, p, tp, dp) for p in pp_ranks for d in dp_ranks for t in tp_ranks]

    all_tp, all_dp, all_pp = range(tp), range(dp), range(pp)
    pp_groups = [ranks([t], [d], all_pp) for d in all_dp for t in all_tp]
    return RankGrid(
        tp_groups=[ranks(all_tp, [d], [p]) for p in all_pp for d in all_dp],
        dp_groups=[ranks([t], all_dp, [p]) for p in all_pp for t in all_tp],
        pp_groups=pp_groups,
        model_parallel_groups=[ranks(all_tp, [d], all_pp) for d in all_dp],
        embedding_groups=[sorted({g[0], g[-1]}) for g in pp_groups],
    )


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the grid and the groups it belongs to (None when of size 1)."""

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    model_parallel_group: Any = None
    embedding_group: Any = None
    world_group: Any = None
    pp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's pipeline, indexed by pp_rank (for p2p)."""

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """The trivial layout: one process, no groups, no torch.distributed."""
        return cls(0, 1, 1, 1, 1, 0, 0, 0, torch.device(device))


def choose_device(requested: str = "auto") -> torch.device:
    """CUDA when present (or asked for), else CPU; the code path is the same."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise MegaliteError("train.device=cuda but CUDA is not available: use auto or cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        return torch.device("cuda", local_gpu(local_rank, torch.cuda.device_count()))
    return torch.device("cpu")


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
    tp: int, pp: int, device: torch.device, timeout_s: float | None = None
) -> ParallelState:
    """Create every process group of the layout; must run on all ranks in the same order.

    Every group times out after `timeout_s` (None: the world group's, which init_distributed
    set from fault.collective_timeout_s), where torch would give the backend's default (NCCL:
    10 minutes). A group that spans the world is the world group, with the world's time-out."""
    if not dist.is_initialized():
        if tp * pp != 1:
            raise MegaliteError(
                f"parallel.tp={tp}, parallel.pp={pp} need {tp * pp} processes: launch with "
                f"`torchrun --nproc-per-node {tp * pp} -m megalite train ...`"
            )
        return ParallelState.single(device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    grid = rank_grid(world_size, tp, pp)
    dp = data_parallel_size(world_size, tp, pp)
    tp_rank, dp_rank, pp_rank = rank_coords(rank, tp, dp)
    if timeout_s is None:
        timeout = group_timeout(dist.group.WORLD, device)
    else:
        timeout = datetime.timedelta(seconds=timeout_s)
    with _starting("creating the process groups", timeout.total_seconds()):
        groups = create_groups(grid, rank, timeout)
    return ParallelState(
        rank=rank,
        world_size=world_size,
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        device=device,
        world_group=dist.group.WORLD,
        pp_ranks=tuple(next(g for g in grid.pp_groups if rank in g)),
        **{f"{axis}_group": group for axis, group in groups.items()},
    )


def create_groups(grid: RankGrid, rank: int, timeout: datetime.timedelta) -> dict[str, Any]:
    """This rank's group of every axis, each made once whatever the number of axes it serves.

    None where the axis's groups have one rank (comm treats None as a group of one: nothing
    to create, no communicator to hold); the world group where a group spans the world; the
    group an earlier axis made where two axes have the same ranks (the embedding pair is the
    pipeline when pp is 2). Every rank takes the same decisions, from the grid alone, so each
    creating call is made on every rank."""
    made: dict[tuple[int, ...], Any] = {tuple(range(dist.get_world_size())): dist.group.WORLD}
    mine: dict[str, Any] = {}
    for axis, groups in grid.by_axis().items():
        fresh = [tuple(g) for g in groups if len(g) > 1 and tuple(g) not in made]
        if fresh:
            made.update(zip(fresh, _create_axis(axis, fresh, rank, timeout)))
        own = next((tuple(g) for g in groups if rank in g), None)
        mine[axis] = made[own] if own is not None and len(own) > 1 else None
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
    saved: dict[str, int], ps: ParallelState, global_batch_size: int, micro_batch_size: int
) -> str | None:
    """What changed between the layout a checkpoint was saved in (`{"tp", "pp", "dp"}`) and this
    run's, in one line, or None when nothing did. The global batch stays: a smaller data-parallel
    world accumulates over more micro-batches per step, a larger one over fewer."""
    now = {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size}
    if saved == now:
        return None

    def describe(layout: dict[str, int]) -> str:
        return " ".join(f"{axis} {layout[axis]}" for axis in ("tp", "pp", "dp"))

    def microbatches(dp: int) -> int:
        return global_batch_size // (micro_batch_size * dp)

    world_before = saved["tp"] * saved["pp"] * saved["dp"]
    return (
        f"world size {world_before} -> {ps.world_size}: layout {describe(saved)} -> "
        f"{describe(now)}, the same global batch of {global_batch_size} as "
        f"{microbatches(saved['dp'])} -> {microbatches(ps.dp_size)} micro-batches of "
        f"{micro_batch_size} per data-parallel rank"
    )
