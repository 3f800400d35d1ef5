"""The executor's step timer: host clocks on CPU; on a GPU, CUDA events that time what the stream
executes, where a host clock would time only the queueing of kernels."""

import time

import pytest
import torch

from megalite.pipeline.executor import IntervalTimer


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
