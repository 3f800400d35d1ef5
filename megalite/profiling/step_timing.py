"""Timing and memory of one rank's training step, for `megalite profile`.

Each measured step's time is cut into parts that do not overlap and add up to the step:
forward, backward (the executor's own intervals), optimizer (gradient finalize, norm, clipping,
update and the ZeRO parameter all-gather, less their collectives), communication exposed (the
time the rank is blocked in a collective, in waiting for an asynchronous one, or in posting
pipeline messages), bubble (waiting for a pipeline receive) and other (the executor's
bookkeeping). Communication overlapped, the rest of an asynchronous collective's duration from
issue to completion, runs beside compute and is reported apart. The bubble is receive waits
only: a rank that finishes its last backward before the others (the pipeline's flush) idles in
the step's next collective, which reads as exposed communication.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from megalite import comm
from megalite.data import TokenBatch
from megalite.optimizer.lr_schedule import learning_rate
from megalite.pipeline.executor import IntervalTimer, timed
from megalite.profiling.memory import SavedActivationTracker, live_bytes, live_devices
from megalite.training.setup import Run
from megalite.training.step import train_step

TIME_PARTS = ("forward", "backward", "optimizer", "comm_exposed", "bubble", "other")
"""The parts of a step's time: disjoint, they add up to the step."""
TIMED_COLLECTIVES = ("all_reduce", "all_reduce_max", "all_gather_flat", "reduce_scatter_flat")
"""Every collective of `comm` a training step issues (the others are built on these)."""


@dataclass
class _AsyncCollective:
    """Marks of one asynchronous collective: perf_counter seconds on CPU, CUDA events recorded
    on the compute stream on a GPU."""

    issued: Any
    wait_started: Any = None
    wait_ended: Any = None
    completed: float | None = None
    """When the backend completed it (CPU, from the work's future); else the wait's end."""


@dataclass
class CollectiveTimes:
    """The asynchronous collectives of the current step: issue, wait and completion."""

    on_cuda: bool
    pending: list[_AsyncCollective] = field(default_factory=list)

    def mark(self) -> Any:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000 if self.on_cuda else end - start

    def overlapped_s(self) -> float:
        """Issue-to-completion time of the step's asynchronous collectives less the time the
        rank waited for them; forgets them (call once per step, after its timer's totals)."""
        total = 0.0
        for op in self.pending:
            if op.wait_ended is None:
                continue  # never waited for: nothing says when it ended
            duration = self.seconds(op.issued, op.completed or op.wait_ended)
            waited = self.seconds(op.wait_started, op.wait_ended)
            total += max(0.0, duration - waited)
        self.pending.clear()
        return total


class _TimedWork:
    """An asynchronous collective's handle whose wait counts as exposed communication."""

    def __init__(self, work: Any, record: _AsyncCollective, times: CollectiveTimes) -> None:
        self.work, self.record, self.times = work, record, times
        if not times.on_cuda:
            # completion as the backend reports it, from its own thread; without a future (gloo's
            # reduce-scatter has none), the end of the wait stands for it (an upper bound of the
            # overlapped time)
            try:
                work.get_future().then(self._completed)
            except (AttributeError, RuntimeError):
                pass

    def _completed(self, _future: Any) -> None:
        self.record.completed = time.perf_counter()

    def wait(self) -> bool:
        with timed("comm"):
            self.record.wait_started = self.times.mark()
            done = self.work.wait()
            self.record.wait_ended = self.times.mark()
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


@contextlib.contextmanager
def time_collectives(device: torch.device) -> Iterator[CollectiveTimes]:
    """Inside the block, every collective of `comm` runs as a `comm` interval of the active step
    timer, and asynchronous ones are tracked from issue to completion."""
    times = CollectiveTimes(device.type == "cuda")

    def wrap(collective: Callable) -> Callable:
        def timed_collective(*args: Any, **kwargs: Any) -> Any:
            with timed("comm"):
                issued = times.mark()
                work = collective(*args, **kwargs)
            if work is None:
                return None
            record = _AsyncCollective(issued)
            times.pending.append(record)
            return _TimedWork(work, record, times)

        return timed_collective

    with contextlib.ExitStack() as patches:
        for name in TIMED_COLLECTIVES:
            patches.enter_context(mock.patch.object(comm, name, wrap(getattr(comm, name))))
        yield times


def measure_step(
    run: Run, tokens: TokenBatch, lr: float, collectives: CollectiveTimes
) -> dict[str, float]:
    """One `train_step`, cut into TIME_PARTS (seconds, from the step's timers), its wall-clock
    `step` time (which the parts add up to, timed independently) and `comm_overlapped`."""
    timer = IntervalTimer(run.ps.device)
    _synchronize(run.ps.device)
    start = time.perf_counter()
    with timer.active(), timer.interval("step"):
        inner = train_step(run, tokens, lr).times
    _synchronize(run.ps.device)
    wall_s = time.perf_counter() - start
    outer = timer.totals()  # step: everything outside the executor and collectives
    executor_parts = inner.forward_s + inner.backward_s + inner.wait_s + inner.p2p_s + inner.comm_s
    parts = {
        "forward": inner.forward_s,
        "backward": inner.backward_s,
        "optimizer": outer["step"] - inner.total_s,
        "comm_exposed": outer.get("comm", 0.0) + inner.comm_s + inner.p2p_s,
        "bubble": inner.wait_s,
        "other": inner.total_s - executor_parts,
    }
    parts["step"] = wall_s
    parts["comm_overlapped"] = collectives.overlapped_s()
    return parts


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_parts(run: Run, saved_activations: int) -> dict[str, int]:
    """Bytes this rank holds: the live training state counted from its tensors and the peak of
    activations saved for backward; on a GPU also what the caching allocator saw at its peak
    (`peak_allocated`, `peak_reserved`, since the last reset)."""
    where = live_devices(run)  # the optimizer's state under offload: named `optimizer_host`
    parts = {(k if where[k] == "gpu" else f"{k}_host"): v for k, v in live_bytes(run).items()}
    parts["activations"] = saved_activations
    if run.ps.device.type == "cuda":
        parts["peak_allocated"] = torch.cuda.max_memory_allocated(run.ps.device)
        parts["peak_reserved"] = torch.cuda.max_memory_reserved(run.ps.device)
    return parts


@contextlib.contextmanager
def torch_trace(trace_dir: Path | None, rank: int) -> Iterator[None]:
    """A torch.profiler trace of the block, written as `rank<r>.pt.trace.json` (Chrome trace
    JSON: Perfetto opens it, and TensorBoard's profiler plugin finds it by that suffix)."""
    if trace_dir is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace_dir.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    prof.export_chrome_trace(str(trace_dir / f"rank{rank}.pt.trace.json"))


def measure_run(
    run: Run,
    next_tokens: Callable[[], TokenBatch],
    warmup_steps: int,
    steps: int,
    trace_dir: Path | None,
) -> tuple[dict[str, float], dict[str, int]]:
    """Warm-up steps, then `steps` measured (and traced) ones, then one step under a saved-
    activation tracker (kept apart: its hooks would slow the timed steps). Returns the mean
    seconds per part of the measured steps and `memory_parts`."""
    cfg = run.cfg

    def lr(step: int) -> float:
        return learning_rate(step, cfg.optim, cfg.train.steps)

    measured = []
    with time_collectives(run.ps.device) as collectives:
        for step in range(warmup_steps):
            measure_step(run, next_tokens(), lr(step), collectives)
        if run.ps.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.ps.device)
        with torch_trace(trace_dir, run.ps.rank):
            for step in range(warmup_steps, warmup_steps + steps):
                measured.append(measure_step(run, next_tokens(), lr(step), collectives))
    model_tensors = [t for chunk in run.chunks for t in (*chunk.parameters(), *chunk.buffers())]
    with SavedActivationTracker(exclude=model_tensors) as saved:
        train_step(run, next_tokens(), lr(warmup_steps + steps))
    times = {name: statistics.fmean(m[name] for m in measured) for name in measured[0]}
    return times, memory_parts(run, saved.peak)
