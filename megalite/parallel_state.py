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
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class DistributedStartError(MegaliteError):
    """The ranks could not form their process groups in time (a rank missing or unreachable)."""


GENERATION_KEY = "megalite/generation"
"""Agent-store counter: one generation per start of the worker group (first start, restarts)."""


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the torchrun world; nccl on CUDA, gloo on CPU. Under torchrun's agent every start
    of the workers (the first, and each restart) rendezvouses in a key space of its own
    (`elastic_store`), so a restarted worker never reads a dead worker's address.

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


def build_parallel_state(tp: int, pp: int, device: torch.device) -> ParallelState:
    """Create every process group of the layout; must run on all ranks in the same order."""
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

    def mine(groups: list[list[int]]) -> Any:
        # new_group is collective over the world: every rank creates every group, keeps its own.
        found = None
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                found = group
        return found

    pp_ranks = next(g for g in grid.pp_groups if rank in g)
    with _starting("creating the process groups"):
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
            tp_group=mine(grid.tp_groups),
            pp_group=mine(grid.pp_groups),
            dp_group=mine(grid.dp_groups),
            model_parallel_group=mine(grid.model_parallel_groups),
            embedding_group=mine(grid.embedding_groups),
            world_group=dist.group.WORLD,
            pp_ranks=tuple(pp_ranks),
        )


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
