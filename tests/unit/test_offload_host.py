"""Offload's host side (optim.offload=cpu): the update runs on this rank's share of the node's
cores whatever OMP_NUM_THREADS says (torchrun sets it to 1), and everything the copy engine moves
lies in one aligned arena per rank (pinned on CUDA; laid out the same on a CPU-only machine)."""

import os

import pytest
import torch
from run_configs import TWO_LAYERS

import megalite.optimizer.adamw as adamw_module
from megalite.config import load_config
from megalite.host_memory import ALIGNMENT, HostArena, arena_layout
from megalite.launch import run_ranks
from megalite.optimizer.offload import update_threads
from megalite.parallel_state import ParallelState
from megalite.training.setup import build_run
from megalite.training.step import train_step

FP32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def torchrun_threads(monkeypatch):
    """torchrun's environment for a rank (OMP_NUM_THREADS=1, so torch starts on one thread) on
    a node of `cores` cores: returns a function setting the cores and LOCAL_WORLD_SIZE."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    def node(cores: int, local_world_size: str | None) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        if local_world_size is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)

    yield node
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "cores,local_world_size,threads",
    [(16, "8", 2), (16, "3", 5), (2, "8", 1), (96, " 8 ", 12), (8, None, 1)],
)
def test_update_threads_share_the_cores_among_the_node_ranks(
    torchrun_threads, cores, local_world_size, threads
):
    """Without LOCAL_WORLD_SIZE (not under torchrun) the count the process has: here one."""
    torchrun_threads(cores, local_world_size)
    assert update_threads() == threads


@pytest.mark.parametrize("value", ["0", "-2", "eight", ""])
def test_bad_local_world_size_is_one_clear_error(torchrun_threads, value):
    torchrun_threads(8, value)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=.* is not a positive integer"):
        update_threads()


def test_the_update_runs_on_the_chosen_threads(torchrun_threads):
    """Every piece's AdamW update runs on cores // LOCAL_WORLD_SIZE threads, not torchrun's
    one, and the rest of the step goes back to the threads it had."""
    torchrun_threads(8, "2")
    seen, pieces = _threads_in_the_update("parallel.bucket_mb=0.05")
    assert len(seen) == pieces > 1
    assert set(seen) == {4}
    assert torch.get_num_threads() == 1


def _assert_arena(arena: HostArena, sizes: list[tuple[int, torch.dtype]]) -> None:
    """One allocation of the sum of the aligned sizes; each view of its size and dtype, on an
    aligned address inside it, none overlapping another, each writable on its own."""
    base = arena.storage.data_ptr()
    assert (
        arena.storage.nbytes()
        == arena.nbytes
        == sum(-(-n * d.itemsize // ALIGNMENT) * ALIGNMENT for n, d in sizes)
    )
    assert base % ALIGNMENT == 0
    spans = []
    for view, (numel, dtype) in zip(arena.views, sizes, strict=True):
        assert (view.numel(), view.dtype, view.device.type) == (numel, dtype, "cpu")
        assert view.untyped_storage().data_ptr() == base
        assert view.data_ptr() % ALIGNMENT == 0
        if numel:
            spans.append((view.data_ptr() - base, view.data_ptr() - base + view.nbytes))
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert all(0 <= start and end <= arena.nbytes for start, end in spans)
    for i, view in enumerate(arena.views):
        view.fill_(i % 100 + 1)
    for i, view in enumerate(arena.views):
        assert bool((view == i % 100 + 1).all())


def test_arena_layout_toy_sizes():
    sizes = [(3, FP32), (0, BF16), (5, BF16), (17, FP32), (33, BF16), (16, FP32)]
    offsets, total = arena_layout(sizes)
    assert offsets == [0, 64, 64, 128, 256, 384] and total == 448
    _assert_arena(HostArena(sizes, pin=False), sizes)
    _assert_arena(HostArena([], pin=False), [])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_arena_at_the_shipped_tiny_size(precision):
    """configs/gpt-tiny.yaml with offload: gradient staging, and the upload staging (16-bit
    parameters) or the master weights (fp32 ones, which go up from there) are views of one
    arena, in piece order; the moments, which the copy engine never touches, are not."""
    cfg = load_config(
        "configs/gpt-tiny.yaml",
        [f"train.precision={precision}", "optim.offload=cpu", "parallel.bucket_mb=4"],
    )
    optimizer = build_run(cfg, ParallelState.single()).optimizer
    placement, states = optimizer.placement, optimizer.states
    outgoing = [s.master if precision == "fp32" else u for s, u in zip(states, placement.uploads)]
    param_dtype = FP32 if precision == "fp32" else BF16
    sizes = [(s.params.numel(), FP32) for s in states]
    sizes += [(s.params.numel(), param_dtype) for s in states]
    assert len(states) > 1 and sum(n for n, _ in sizes) > 10**7
    _assert_arena(placement.arena, sizes)
    arena_views = [v.data_ptr() for v in placement.arena.views]
    assert [t.data_ptr() for t in placement.host_grads + outgoing] == arena_views
    base = placement.arena.storage.data_ptr()
    for state in states:
        for moment in (state.exp_avg, state.exp_avg_sq):
            assert moment.untyped_storage().data_ptr() != base


def _threads_in_the_update(*overrides: str) -> tuple[list[int], int]:
    """The thread count each piece's AdamW update ran on in one offloaded step, and the number
    of pieces."""
    cfg = load_config(None, [*TWO_LAYERS, "optim.offload=cpu", *overrides])
    run = build_run(cfg, ParallelState.single())
    seen = []
    update = adamw_module.AdamW.update

    def spy(self, *args):
        seen.append(torch.get_num_threads())
        update(self, *args)

    adamw_module.AdamW.update = spy
    try:
        train_step(run, torch.randint(0, 500, (4, 33)), 1e-3)
    finally:
        adamw_module.AdamW.update = update
    return seen, len(run.optimizer.states)


def _thread_counts_in_the_update() -> set[int]:
    return set(_threads_in_the_update()[0])


def test_forked_ranks_keep_their_one_thread(monkeypatch):
    """Ranks forked by run_ranks (no LOCAL_WORLD_SIZE) after this process has used a pool of
    OpenMP threads update on the one thread run_ranks gives them: more would hang in libgomp
    (the forked child of a process that used its pool)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.randn(1 << 22).add_(1).sum(), torch.randn(512, 512) @ torch.randn(512, 512)  # pool up
    torch.set_num_threads(before)
    assert run_ranks(2, _thread_counts_in_the_update, timeout=120) == [{1}, {1}]
