"""The executor's step timer: host clocks on CPU; on a GPU, CUDA events that time what the stream
executes, where a host clock would time only the queueing of kernels."""

import time

import pytest
import torch

from megalite import comm
from megalite.pipeline.executor import IntervalTimer, StepTimes
from megalite.profiling.step_timing import CommTimer

pytestmark = pytest.mark.serial  # asserts on wall-clock time (Makefile)


def test_host_timer_sums_each_name_on_cpu():
    timer = IntervalTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.interval("wait"):
            time.sleep(0.02)
    with timer.interval("compute"):
        pass
    totals = timer.totals()
    assert totals.keys() == {"wait", "compute"}
    assert 0.04 <= totals["wait"] < 0.2
    assert totals["compute"] < 0.01


def test_nested_intervals_count_once_for_the_innermost_name():
    """A collective inside a forward is communication, not forward: self times partition the
    outermost interval, so a step's parts add up to the step. (Checked against the test's own
    clock readings, which bracket each interval's marks: exact up to those readings, whatever
    the load on the machine does to the sleeps.)"""
    timer = IntervalTimer(torch.device("cpu"))
    clock = time.perf_counter
    t0 = clock()
    with timer.interval("step"):
        time.sleep(0.01)
        t1 = clock()
        with timer.interval("forward"):
            time.sleep(0.02)
            t2 = clock()
            with timer.interval("comm"):
                time.sleep(0.03)
            t3 = clock()
        t4 = clock()
    t5 = clock()
    totals = timer.totals()
    tolerance = 5e-3  # a preempted process reads its clock late
    assert totals["comm"] == pytest.approx(t3 - t2, abs=tolerance)
    assert totals["forward"] == pytest.approx((t2 - t1) + (t4 - t3), abs=tolerance)
    assert totals["step"] == pytest.approx((t1 - t0) + (t5 - t4), abs=tolerance)
    assert sum(totals.values()) == pytest.approx(t5 - t0, abs=tolerance)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 3)])
def test_bubble_is_idle_time_relative_to_compute(pp, m):
    """The papers' bubble: in a balanced 1F1B pipeline a rank computes m micro-batches of one
    forward (1) and one backward (2) and idles (p - 1) of them: (p - 1) / m (above 1 when
    m < p - 1), not the share of the step (p - 1) / (m + p - 1)."""
    times = StepTimes(forward_s=1.0 * m, backward_s=2.0 * m, wait_s=3.0 * (pp - 1))
    assert times.compute_s == 3.0 * m
    assert times.bubble_fraction == pytest.approx((pp - 1) / m)


def test_step_times_of_an_empty_run_have_no_bubble():
    assert StepTimes().bubble_fraction == 0.0


def _matmuls(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x @ x / x.shape[0] ** 0.5  # keeps the values' scale
    return x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_execution_and_stream_waits():
    """Compute queued in a blink but executed for tens of milliseconds reads as the execution;
    a stream waiting on another stream's work (what `work.wait()` does for NCCL) reads as that
    work's duration, while the host does not wait at all."""
    x = torch.randn(4096, 4096, device="cuda")
    _matmuls(x, 2)  # warm up cuBLAS
    torch.cuda.synchronize()
    timer = IntervalTimer(torch.device("cuda"))

    start = time.perf_counter()
    with timer.interval("compute"):
        _matmuls(x, 20)
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    executed = time.perf_counter() - start

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _matmuls(x, 20)
        finished = torch.cuda.Event()
        finished.record()
    start = time.perf_counter()
    with timer.interval("wait"):
        torch.cuda.current_stream().wait_event(finished)
    host_wait = time.perf_counter() - start

    totals = timer.totals()
    assert totals["compute"] == pytest.approx(executed, rel=0.2)
    assert totals["compute"] > 5 * queued
    assert totals["wait"] == pytest.approx(totals["compute"], rel=0.3)
    assert totals["wait"] > 5 * host_wait


class _SlowWork:
    """An asynchronous collective that completes `seconds` after it is issued."""

    def __init__(self, seconds: float) -> None:
        self.done_at = time.perf_counter() + seconds

    def wait(self) -> bool:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return True

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at


def test_async_collective_splits_into_overlapped_and_exposed(monkeypatch, gloo_as_it_is):
    """Issued on the tp group, then compute, then a wait for the rest of its 50 ms: the time
    until the wait is overlapped with compute, the wait is exposed (the rank was blocked), both
    counted for tp; the comm timer sees it through `comm.observe`, with `comm` unpatched. (The
    backend is faked: `dist.all_reduce` returns a slow handle on a pretend two-rank group.)"""
    tp_group, dp_group = object(), object()
    monkeypatch.setattr(comm, "size", lambda group: 2)
    monkeypatch.setattr(comm.dist, "all_reduce", lambda *args, **kwargs: _SlowWork(0.05))
    cpu = torch.device("cpu")
    timer = IntervalTimer(cpu)
    comm_timer = CommTimer({"tp": tp_group, "dp": dp_group}, cpu)
    comm_timer.step_timer = timer  # blocked time lands in the step's timer it is given
    with comm.observe(comm_timer), timer.interval("step"):
        t0 = time.perf_counter()
        work = comm.all_reduce(torch.zeros(1), tp_group, async_op=True)
        time.sleep(0.03)
        t1 = time.perf_counter()
        work.wait()
        t2 = time.perf_counter()
    comm.all_reduce(torch.zeros(1), tp_group, async_op=True).wait()  # not observed any more
    comm_timer.step_timer = None
    with comm.observe(comm_timer):  # observed, but no step timer: only the comm timer's own
        comm.all_reduce(torch.zeros(1), dp_group, async_op=True).wait()
    assert [i.name for i in timer.intervals] == ["step", "comm", "comm"]
    assert t2 - t0 >= 0.05
    assert timer.totals()["comm"] == pytest.approx(t2 - t1, abs=5e-3)
    totals = comm_timer.step_totals()
    assert totals["tp_comm_exposed"] == pytest.approx(t2 - t1, abs=5e-3)
    assert totals["tp_comm_overlapped"] == pytest.approx(t1 - t0, abs=5e-3)
    assert totals["dp_comm_exposed"] + totals["dp_comm_overlapped"] >= 0.05
    assert totals["other_comm_exposed"] == totals["other_comm_overlapped"] == 0
    assert sum(comm_timer.step_totals().values()) == 0  # forgotten once read
