"""Process groups at scale, in one process on torch's `fake` backend: what each rank creates when
it builds the parallel state of a 1,024-rank world (tp 8 x pp 8 x dp 16) and of the shipped
configs' layouts; that every group carries the configured time-out and none has one rank; and
the device choice when each rank sees only its own GPU."""

import datetime
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megalite import parallel_state
from megalite.config import load_config
from megalite.errors import MegaliteError
from megalite.parallel_dims import ParallelDims
from megalite.parallel_state import build_parallel_state, choose_device

TIMEOUT_S = 321.0

# (tp, pp, world size): the issue's 1,024 ranks, its tp 2 x pp 2 run, and the shipped configs'
# layouts at the world sizes their headers name (llama-7b: 4 nodes x 8 GPUs).
SHIPPED = {"gpt2-1.3b.yaml": 8, "llama-7b.yaml": 32, "gpt2-124m.yaml": 8, "gpt-tiny.yaml": 4}


def _shipped_layout(name: str) -> tuple[int, int, int]:
    p = load_config(f"configs/{name}", []).parallel
    return p.tp, p.pp, SHIPPED[name]


@pytest.fixture
def fake_world() -> Iterator[Any]:
    """Joins a fake world as a given rank; leaves it at the end of the test."""

    def join(rank: int, world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def new_group_calls(monkeypatch) -> list[tuple[list[int], dict]]:
    """Every dist.new_group call (ranks, keyword arguments), passed on to torch."""
    calls, real = [], dist.new_group

    def spy(ranks, **kwargs):
        calls.append((list(ranks), kwargs))
        return real(ranks, **kwargs)

    monkeypatch.setattr(dist, "new_group", spy)
    return calls


def _named_groups(world_size: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    return ParallelDims.for_world(world_size, tp=tp, pp=pp).named_groups()


def _expected_groups(world_size: int, tp: int, pp: int) -> list[tuple[int, ...]]:
    """The groups that need a process group of their own: each name's of more than one rank,
    the world's included (a communicator per purpose)."""
    named = _named_groups(world_size, tp, pp).values()
    return [tuple(g) for groups in named for g in groups if len(g) > 1]


def _named(ps: Any, name: str) -> Any:
    """The group a name stands for, asked for as a run asks: by the axes it spans."""
    axes = ps.dims.group_axes()[name]
    group = ps.group(*axes) if axes else ps.embedding_group
    assert group is ps.groups.get(name), name
    return group


def _check_state(ps: Any, rank: int, world_size: int, tp: int, pp: int) -> None:
    """Each axis's field is None when this rank's group of that axis has one rank (or it is in
    none), else a group with exactly the grid's ranks."""
    for axis, groups in _named_groups(world_size, tp, pp).items():
        own = next((g for g in groups if rank in g), [rank])
        group = _named(ps, axis)
        if len(own) == 1:
            assert group is None, axis
        else:
            assert dist.get_process_group_ranks(group) == own, axis


@pytest.mark.parametrize(
    "tp,pp,world_size,ranks",
    [
        (8, 8, 1024, (0, 5, 517, 1023)),
        (2, 2, 4, (0, 1, 2, 3)),
        *[(*_shipped_layout(name), None) for name in SHIPPED],
    ],
    ids=["1024-tp8-pp8", "4-tp2-pp2", *SHIPPED],
)
@pytest.mark.serial
def test_each_group_is_created_once_with_the_timeout_and_none_has_one_rank(
    fake_world, new_group_calls, tp, pp, world_size, ranks
):
    """At first: 464 new_group calls per rank at 1,024 ranks and 11 at tp 2 x pp 2 (4 of them
    size-1 groups), none with a time-out. Then one call per group of more than one rank that
    is not the world, axes with the same ranks sharing one. Now one call per named group of
    more than one rank, each carrying the time-out: 528 at 1,024 ranks, since dp_cp is dp's
    ranks at cp 1 but a purpose of its own."""
    expected = _expected_groups(world_size, tp, pp)
    for rank in ranks or range(world_size):
        fake_world(rank, world_size)
        new_group_calls.clear()
        start = time.perf_counter()
        ps = build_parallel_state(tp, pp, torch.device("cpu"), timeout_s=TIMEOUT_S)
        seconds = time.perf_counter() - start
        created = [tuple(r) for r, _ in new_group_calls]
        assert sorted(created) == sorted(expected)  # each once per name, no size-1 group
        assert all(
            kw["timeout"] == datetime.timedelta(seconds=TIMEOUT_S) for _, kw in new_group_calls
        )
        assert seconds < 2.0  # measured ~8 ms at 1,024 ranks (528 calls): non-members return
        _check_state(ps, rank, world_size, tp, pp)
        assert ps.world_group is dist.group.WORLD


def test_the_issue_layout_needs_seven_groups_per_rank(fake_world, new_group_calls):
    """tp 2 x pp 2 on 4 ranks: the two tp pairs, the two pipelines, the model-parallel group
    (the world's ranks) and the two embedding pairs (the pipelines' ranks), each its own
    communicator. dp is 1 (no group)."""
    fake_world(0, 4)
    ps = build_parallel_state(2, 2, torch.device("cpu"), timeout_s=TIMEOUT_S)
    pipelines = [[0, 2], [1, 3]]
    assert [r for r, _ in new_group_calls] == [[0, 1], [2, 3], *pipelines, [0, 1, 2, 3], *pipelines]
    assert ps.group("dp") is None
    assert ps.group("tp", "pp") is not dist.group.WORLD
    assert ps.embedding_group is not ps.group("pp")


class _Split:
    """What the spied split_group hands back: the ranks of this rank's group."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks


def test_a_bound_device_splits_each_axis_once(fake_world, new_group_calls, monkeypatch):
    """With NCCL's device bound, every world rank takes part in every split; one split_group per
    name (6 at 1,024 ranks) replaces one new_group per group (528), each a world-wide split."""
    rank, splits = 517, []

    def split_group(split_ranks, timeout, group_desc):
        splits.append((group_desc, split_ranks, timeout))
        return next((_Split(g) for g in split_ranks if rank in g), None)

    monkeypatch.setattr(dist, "split_group", split_group)
    fake_world(rank, 1024)
    dist.group.WORLD.bound_device_id = torch.device("cuda", 0)  # as init_distributed's device_id
    ps = build_parallel_state(8, 8, torch.device("cpu"), timeout_s=TIMEOUT_S)
    assert new_group_calls == []
    grid = _named_groups(1024, 8, 8)
    # cp's groups have one rank: no split; dp_cp's are dp's ranks (cp is 1) but split apart
    split_axes = ("tp", "dp", "pp", "model_parallel", "dp_cp", "embedding")
    assert [(axis, ranks) for axis, ranks, _ in splits] == [(a, grid[a]) for a in split_axes]
    assert {timeout for *_, timeout in splits} == {datetime.timedelta(seconds=TIMEOUT_S)}
    for axis, groups in grid.items():
        own = next((g for g in groups if rank in g and len(g) > 1), None)  # None: a group of one
        group = _named(ps, axis)
        assert (group.ranks if group is not None else None) == own, axis


def test_without_a_timeout_the_groups_take_the_worlds(fake_world, new_group_calls, monkeypatch):
    fake_world(0, 4)
    world_timeout = datetime.timedelta(seconds=77)
    monkeypatch.setattr(parallel_state, "group_timeout", lambda group, device: world_timeout)
    build_parallel_state(2, 2, torch.device("cpu"))
    assert {kw["timeout"] for _, kw in new_group_calls} == {world_timeout}


@pytest.fixture
def gpus(monkeypatch) -> Any:
    """Pretend this process sees `n` GPUs as LOCAL_RANK `local_rank`."""

    def see(n: int, local_rank: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))

    return see


def test_a_rank_that_sees_one_gpu_uses_it(gpus):
    """CUDA_VISIBLE_DEVICES per rank: local rank 3 sees one device, cuda:0 (was cuda:3)."""
    gpus(1, 3)
    assert choose_device("auto") == torch.device("cuda", 0)


def test_a_rank_that_sees_the_nodes_gpus_takes_its_local_rank(gpus):
    gpus(8, 3)
    assert choose_device("cuda") == torch.device("cuda", 3)


def test_more_local_ranks_than_gpus_is_one_clear_error(gpus):
    gpus(2, 3)
    with pytest.raises(MegaliteError, match="LOCAL_RANK=3 but this process sees 2 GPUs"):
        choose_device("auto")


def test_cuda_binds_the_device_at_init(monkeypatch):
    """device_id reaches init_process_group on CUDA (eager NCCL init, subgroups split from the
    world); gloo gets none (it takes no accelerator)."""
    seen = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.append(kw))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    parallel_state.init_distributed(torch.device("cuda", 0), 30)
    parallel_state.init_distributed(torch.device("cpu"), 30)
    assert [(kw["backend"], kw.get("device_id")) for kw in seen] == [
        ("nccl", torch.device("cuda", 0)),
        ("gloo", None),
    ]


def test_a_backend_that_keeps_no_timeout_asks_for_one(fake_world):
    fake_world(0, 4)
    with pytest.raises(MegaliteError, match="fake backend does not say its time-out: pass"):
        build_parallel_state(2, 2, torch.device("cpu"))
