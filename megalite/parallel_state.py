"""Who talks to whom: the rank grid and the process groups built from it.

Ranks are laid out as in Megatron-LM: tp varies fastest (keep it inside a node), then dp, then
pp: `rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank`. `rank_grid` is pure so the layout is
testable without processes; `ParallelState` is built once and passed to whatever needs a group.
Nothing else in megalite creates process groups.
"""

from __future__ import annotations

import datetime
import os
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


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the torchrun world (env:// rendezvous); nccl on CUDA, gloo on CPU.

    A single process without torchrun variables stays out of torch.distributed entirely.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return 0, 1
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.get_rank(), dist.get_world_size()


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
