"""The executor's step timer: host clocks on CPU; on a GPU, CUDA events that time what the stream
executes, where a host clock would time only the queueing of kernels."""

import time

import pytest
import torch

from megalite.pipeline.executor import IntervalTimer, StepTimes, timed


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
    outermost interval, so a step's parts add up to the step."""
    timer = IntervalTimer(torch.device("cpu"))
    start = time.perf_counter()
    with timer.interval("step"):
        time.sleep(0.01)
        with timer.interval("forward"):
            time.sleep(0.02)
            with timer.interval("comm"):
                time.sleep(0.03)
    elapsed = time.perf_counter() - start
    totals = timer.totals()
    assert 0.01 <= totals["step"] < 0.02 + 0.01
    assert 0.02 <= totals["forward"] < 0.03 + 0.01
    assert 0.03 <= totals["comm"]
    assert sum(totals.values()) == pytest.approx(elapsed, abs=1e-3)


def test_timed_records_into_the_innermost_active_timer_only():
    outer, inner = IntervalTimer(torch.device("cpu")), IntervalTimer(torch.device("cpu"))
    with timed("comm"):  # no active timer: nothing to record into, and no error
        pass
    with outer.active():
        with timed("comm"):
            time.sleep(0.01)
        with inner.active(), timed("comm"):
            time.sleep(0.02)
    assert outer.totals()["comm"] == pytest.approx(0.01, abs=0.008)
    assert inner.totals()["comm"] >= 0.02
    with timed("comm"):  # both released
        pass
    assert len(outer.intervals) == len(inner.intervals) == 1


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
