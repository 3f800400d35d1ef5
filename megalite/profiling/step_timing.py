"""Timing and memory of one rank's training step, for `megalite profile`.

Each measured step's time is cut into parts that do not overlap and add up to the step:
forward, backward (the executor's own intervals), optimizer (gradient finalize, norm, clipping,
update and the ZeRO parameter all-gather, less their collectives), communication exposed by
axis (tp, cp, dp, other: the time the rank is blocked in a collective, in waiting for an
asynchronous one or for the context-parallel ring's messages, or in posting pipeline
messages), bubble (waiting for a pipeline receive) and other (the executor's bookkeeping).
Communication overlapped, by axis, is the time an asynchronous collective or a ring message was
in flight before the rank began to wait for it: it runs beside compute (the tp input-gradient
reduction beside the weight-gradient GEMMs, the ring's K/V blocks beside each block of
attention, the dp buckets beside the backward) and is reported apart.

The axes are the groups' (`CommTimer.of`): tp; cp, the context-parallel ring's p2p messages
(told from the pipeline's by their peer) and the collectives over the cp group of
`parallel.cp_comm=allgather`; dp, the collectives over the ranks that hold the same weights, dp
x cp, where gradients are reduced and ZeRO shards (with cp 1 the dp group; with dp 1 the cp
group, whose all-gather attention then reads as dp). The bubble is receive waits only: a rank that
finishes its last backward before the others (the pipeline's flush) idles in the step's next
collective, which reads as exposed communication.

Collectives are observed through `comm.observe` (a `CommTimer`), not by patching `comm`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megalite import comm, comm_trace
from megalite.data import TokenBatch
from megalite.optimizer.lr_schedule import learning_rate
from megalite.pipeline.executor import IntervalTimer
from megalite.profiling.memory import SavedActivationTracker, live_bytes, live_devices
from megalite.training.setup import Run
from megalite.training.step import train_step

AXES = ("tp", "cp", "ep", "dp", "other")
"""Communication by the axis of its group: tensor parallel, context parallel, expert parallel
(the experts' all-to-alls), data parallel (the replicas: dp x cp, and cp x edp for the
experts' gradients), and the rest (the pipeline's messages, and collectives over the world,
model-parallel or pipeline groups)."""
TIME_PARTS = (
    "forward",
    "backward",
    "optimizer",
    *(f"{axis}_comm_exposed" for axis in AXES),
    "bubble",
    "other",
)
"""The parts of a step's time: disjoint, they add up to the step."""


@dataclass
class _InFlight:
    """Marks of one asynchronous collective: perf_counter seconds on CPU, CUDA events recorded
    on the compute stream on a GPU."""

    axis: str
    issue_ended: Any
    wait_started: Any = None
    completed: float | None = None
    """When the backend completed it (CPU, from the work's future); None: unknown."""


class CommTimer(comm.CommObserver):
    """The profiler's observer of communication (register it with `comm.observe`): the time the
    rank is blocked in each collective (exposed) runs as a `comm` interval of the step's timer
    (`step_timer`, set for each measured step), and is summed by axis; an asynchronous
    collective's time in flight before its wait began (overlapped: the rank computed
    meanwhile) is summed by axis too. Messages to and from `ring_peers` (the cp ring's) are
    timed the same way, each batch from its posting to its wait; the pipeline's messages are
    the executor's to time (its `p2p` and `wait` intervals) and are left alone here."""

    def __init__(
        self,
        groups: Mapping[str, Any] | Iterable[tuple[str, Any]],
        device: torch.device,
        ring_peers: frozenset[int] = frozenset(),
    ) -> None:
        """`groups`: axis -> group, or (axis, group) pairs where two axes may name one group (a
        later pair takes it: with dp 1 the dp x cp group is the cp group)."""
        self.on_cuda = device.type == "cuda"
        pairs = groups.items() if isinstance(groups, Mapping) else groups
        self.axis_of = {id(group): axis for axis, group in pairs if group is not None}
        self.ring_peers = ring_peers
        self.blocked: list[tuple[str, Any, Any]] = []
        """(axis, start, end) of every time the rank was blocked, this step."""
        self.in_flight: dict[int, _InFlight] = {}
        """Issued and not yet waited for, by call number (may cross steps: ZeRO's parameter
        all-gather is issued after the update and waited for in the next forward)."""
        self.waited: list[_InFlight] = []
        self.last_issue: tuple[int, Any, Any] | None = None
        self.step_timer: IntervalTimer | None = None
        """The timer of the step being measured: blocked time is a `comm` interval of it, so
        the step's other parts leave it out."""

    @classmethod
    def of(cls, ps: Any) -> CommTimer:
        """The observer of `ps`'s groups: tp, cp (the ring's peers), and dp, the replicas of the
        weights (dp x cp, and cp x edp for experts: gradients, ZeRO's gather) as well as the dp
        group itself. ep is told by the call (an all-to-all), since its group may be dp's."""
        groups = [("tp", ps.group("tp")), ("cp", ps.group("cp")), ("dp", ps.group("dp"))]
        groups += [("dp", ps.group(*view.replica_axes)) for view in ps.dims.views.values()]
        peers = frozenset(ps.ranks("cp")) - {ps.rank} if ps.size("cp") > 1 else frozenset()
        return cls(groups, ps.device, peers)

    def _axis(self, call: comm_trace.Call) -> str | None:
        """The axis of a call; None for a pipeline message (the executor times those)."""
        if call.peer is not None:
            return "cp" if call.peer in self.ring_peers else None
        if call.op == "all_to_all":
            return "ep"
        return self.axis_of.get(id(call.group), "other")

    def mark(self) -> Any:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000 if self.on_cuda else end - start

    @contextlib.contextmanager
    def blocking(self, call: comm_trace.Call) -> Iterator[None]:
        axis = self._axis(call)
        if axis is None:
            yield
            return
        in_step = self.step_timer.interval("comm") if self.step_timer else contextlib.nullcontext()
        with in_step:
            start = self.mark()
            try:
                yield
            finally:
                end = self.mark()
        self.blocked.append((axis, start, end))
        self.last_issue = (call.number, start, end)
        waited = self.in_flight.pop(call.number, None)
        if waited is not None:
            waited.wait_started = start
            self.waited.append(waited)
        elif call.peer is not None:  # a ring batch posted: in flight until its wait (same call)
            self.in_flight[call.number] = _InFlight(axis, end)

    def started(self, call: comm_trace.Call, work: Any) -> None:
        number, _, issue_ended = self.last_issue
        assert number == call.number, "an asynchronous collective is issued inside `blocking`"
        record = _InFlight(self._axis(call) or "other", issue_ended)
        self.in_flight[call.number] = record
        if not self.on_cuda:
            # completion as the backend reports it, from its own thread; without a future (gloo's
            # reduce-scatter has none), the wait's start stands for it (an upper bound)
            try:
                work.get_future().then(lambda _: setattr(record, "completed", time.perf_counter()))
            except (AttributeError, RuntimeError):
                pass

    def _overlapped(self, op: _InFlight) -> float:
        if op.completed is None:
            return max(0.0, self.seconds(op.issue_ended, op.wait_started))
        return max(0.0, min(op.completed, op.wait_started) - op.issue_ended)

    def step_totals(self) -> dict[str, float]:
        """`{axis}_comm_exposed` and `{axis}_comm_overlapped` seconds of the collectives blocked
        in or waited for since the last call (once per step, after the step timer's totals);
        an exposed and an overlapped time add up to the collectives' issue-to-completion time."""
        totals = {f"{axis}_comm_{kind}": 0.0 for axis in AXES for kind in ("exposed", "overlapped")}
        for axis, start, end in self.blocked:
            totals[f"{axis}_comm_exposed"] += self.seconds(start, end)
        for op in self.waited:
            totals[f"{op.axis}_comm_overlapped"] += self._overlapped(op)
        self.blocked.clear()
        self.waited.clear()
        return totals


def measure_step(
    run: Run, tokens: TokenBatch, lr: float, comm_timer: CommTimer
) -> dict[str, float]:
    """One `train_step`, cut into TIME_PARTS (seconds, from the step's timer), its wall-clock
    `step` time (which the parts add up to, timed independently), `{axis}_comm_overlapped` and
    `weight`, the part of `backward` that a split backward's W steps took.
    One timer holds the step: the executor's intervals inside it, and the comm timer's
    collectives as `comm` intervals, so its exposed times are what the other parts leave out;
    posting pipeline messages counts as `other`."""
    timer = IntervalTimer(run.ps.device)
    comm_timer.step_timer = timer
    _synchronize(run.ps.device)
    # the host clock read inside the step's interval: a garbage collection just outside it
    # would fall into the wall time and no part
    with timer.interval("step"):
        start = time.perf_counter()
        metrics = train_step(run, tokens, lr, timer=timer)
        _synchronize(run.ps.device)
        wall_s = time.perf_counter() - start
    inner = metrics.times
    comm_timer.step_timer = None
    outside_executor = timer.totals()["step"]  # less the executor's run and the collectives
    comm_times = comm_timer.step_totals()
    comm_times["other_comm_exposed"] += inner.p2p_s
    executor_parts = inner.forward_s + inner.backward_s + inner.wait_s + inner.p2p_s + inner.comm_s
    parts = {
        "forward": inner.forward_s,
        "backward": inner.backward_s,
        "optimizer": outside_executor,
        **comm_times,
        "bubble": inner.wait_s,
        "other": inner.total_s - executor_parts,
    }
    parts["step"] = wall_s
    parts["weight"] = inner.weight_s  # of "backward": a split backward's W steps
    # MoE routing over the global batch (0 without experts)
    parts["expert_imbalance"] = metrics.expert_imbalance or 0.0
    parts["dropped_tokens"] = float(metrics.dropped_tokens or 0)
    return parts


def _synchronize(device: torch.device) -> None:
    """Wait for the compute stream, as `megalite train` does at the end of a step (it reads the
    loss and bubble back): not for the whole device, whose other streams may still carry what
    training overlaps with its next step (ZeRO's parameter all-gather on the NCCL stream)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


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
def torch_trace(trace_dir: Path, rank: int) -> Iterator[None]:
    """A torch.profiler trace of the block, written as `rank<r>.pt.trace.json` (Chrome trace
    JSON: Perfetto opens it, and TensorBoard's profiler plugin finds it by that suffix)."""
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
    """Warm-up steps, then `steps` measured ones, then (with `trace_dir`) as many traced ones,
    then one step under a saved-activation tracker. The profiler and the tracker slow the steps
    they watch, so neither watches a measured one. Returns the parts of the median measured
    step (by its `step` time: a steady step, as `megalite train` logs it, which one slow step
    cannot move as it moves a mean), `step_min` and `step_max` of the measured steps,
    `traced_step` (the median traced step, 0 without a trace) and `memory_parts`."""
    cfg = run.cfg

    def lr(step: int) -> float:
        return learning_rate(step, cfg.optim, cfg.train.steps)

    def measure(first: int, count: int) -> list[dict[str, float]]:
        return [
            measure_step(run, next_tokens(), lr(step), comm_timer)
            for step in range(first, first + count)
        ]

    traced: list[dict[str, float]] = []
    with comm.observe(CommTimer.of(run.ps)) as comm_timer:
        measure(0, warmup_steps)
        if run.ps.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.ps.device)
        measured = measure(warmup_steps, steps)
        if trace_dir is not None:
            with torch_trace(trace_dir, run.ps.rank):
                traced = measure(warmup_steps + steps, steps)
    model_tensors = [t for chunk in run.chunks for t in (*chunk.parameters(), *chunk.buffers())]
    with SavedActivationTracker(exclude=model_tensors) as saved:
        train_step(run, next_tokens(), lr(warmup_steps + steps + len(traced)))
    seconds = [m["step"] for m in measured]
    times = dict(sorted(measured, key=lambda m: m["step"])[(len(measured) - 1) // 2])
    times.update(step_min=min(seconds), step_max=max(seconds))
    times["traced_step"] = statistics.median(m["step"] for m in traced) if traced else 0.0
    return times, memory_parts(run, saved.peak)
