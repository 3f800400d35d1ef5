"""The process groups on real gloo ranks: each axis's group sums over exactly its grid ranks, gloo
enforces the configured time-out on every group (fault.collective_timeout_s through the training
loop's setup, else the world's), and layouts built one after another in one process agree."""

import datetime

import pytest
import torch
import torch.distributed as dist
from equivalence import TINY

from megalite import comm
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_dims import ParallelDims
from megalite.parallel_state import build_parallel_state, group_timeout
from megalite.training.loop import setup_topology

RUN_TIMEOUT_S = 120.0
CPU = torch.device("cpu")


def _groups(ps) -> dict[str, tuple[list[int], float, float] | None]:
    """Per axis: the group's ranks, its time-out in seconds and the sum of (rank + 1) over it;
    None where this rank has no group on that axis."""
    seen = {}
    for axis in ps.dims.named_groups():
        group = ps.groups.get(axis)
        if group is None:
            seen[axis] = None
            continue
        total = torch.tensor([ps.rank + 1.0])
        comm.all_reduce(total, group)
        timeout = group_timeout(group, CPU).total_seconds()
        seen[axis] = (dist.get_process_group_ranks(group), timeout, total.item())
    return seen


def _layouts(layouts: list[tuple[int, int]], timeout_s: float | None) -> list[dict]:
    return [_groups(build_parallel_state(tp, pp, CPU, timeout_s)) for tp, pp in layouts]


def _check(rank: int, world_size: int, tp: int, pp: int, seen: dict, timeout_s: float) -> None:
    for axis, groups in ParallelDims.for_world(world_size, tp=tp, pp=pp).named_groups().items():
        own = next((g for g in groups if rank in g), [rank])
        if len(own) == 1:
            assert seen[axis] is None, (rank, axis)
        else:  # a group of its own even where it spans the world: the time-out given
            assert seen[axis] == (own, timeout_s, sum(r + 1.0 for r in own)), (rank, axis)


@pytest.mark.parametrize("timeout_s", [321.0, None], ids=["given", "the-worlds"])
def test_every_group_sums_over_its_ranks_and_carries_the_timeout(timeout_s):
    """Layouts of 8 ranks one after another in each process (pp 4 leaves the middle stages out
    of the embedding pairs; at tp 2 x pp 2 the embedding pairs have the pipeline's ranks; tp 1
    x pp 1 is pure data parallelism over the world), then the first again."""
    layouts = [(2, 2), (1, 4), (2, 1), (1, 1), (2, 2)]
    results = run_ranks(8, _layouts, layouts, timeout_s, timeout=RUN_TIMEOUT_S)
    for rank, per_layout in enumerate(results):
        for (tp, pp), seen in zip(layouts, per_layout):
            _check(rank, 8, tp, pp, seen, timeout_s or RUN_TIMEOUT_S)


def _setup_groups() -> dict:
    cfg = load_config(
        None,
        [
            *TINY,
            "parallel.tp=2",
            "parallel.pp=2",
            "train.device=cpu",
            "fault.collective_timeout_s=321",
        ],
    )
    return _groups(setup_topology(cfg))


def test_the_fault_timeout_reaches_every_group_of_the_training_setup():
    """The issue's run: tp 2 x pp 2, fault.collective_timeout_s=321. Before, none of its groups
    carried it (gloo's default, 30 minutes)."""
    for rank, seen in enumerate(run_ranks(4, _setup_groups, timeout=RUN_TIMEOUT_S)):
        assert seen["dp"] is None
        assert seen["tp"][1] == seen["pp"][1] == seen["embedding"][1] == 321.0, rank
        _check(rank, 4, 2, 2, seen, 321.0)


def test_group_timeout_reads_what_gloo_was_given():
    def made() -> float:
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=45))
        return group_timeout(group, CPU).total_seconds()

    assert run_ranks(2, made, timeout=RUN_TIMEOUT_S) == [45.0, 45.0]


def _purposes(tp: int, pp: int, cp: int, ep: int) -> list[tuple[str, str]]:
    """The pairs of names that share a group object, or a name whose group is the world's."""
    ps = build_parallel_state(tp, pp, CPU, cp=cp, ep=ep)
    held = {name: group for name, group in ps.groups.items() if group is not None}
    shared = [(a, b) for a in held for b in held if a < b and held[a] is held[b]]
    return shared + [(name, "world") for name, g in held.items() if g is dist.group.WORLD]


@pytest.mark.parametrize(
    "tp,pp,cp,ep",
    [(1, 1, 2, 1), (1, 2, 1, 1), (1, 1, 1, 4), (1, 1, 2, 2), (2, 2, 1, 1)],
    ids=["cp-is-dp-cp", "pp2-embedding-is-pp", "ep-is-dp", "edp1-expert-dp-is-cp", "mp-is-world"],
)
def test_every_purpose_has_a_communicator_of_its_own(tp, pp, cp, ep):
    """NCCL runs one group's work in issue order on one stream, so names whose ranks coincide
    (in each case named here) still get a group each, and none is the world's, which carries
    the run's control traffic."""
    assert run_ranks(4, _purposes, tp, pp, cp, ep, timeout=RUN_TIMEOUT_S) == [[]] * 4
