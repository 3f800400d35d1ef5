"""Counts of what a GPU would wait for in one training step (issue 47): the kernels the host
launches, the times it waits for the device, and what torch.compile made of the code.

A small model's step on a GPU is bound by the host: every launch costs microseconds of Python
and driver time, and every host sync drains the device's queue, so the GPU idles until the host
has queued the next kernels. Both are counted here with the same code on CPU and CUDA, so a
CPU test suite can hold the numbers.

- **Launches**: the ATen operators dispatched (seen by a `TorchDispatchMode`, below autograd
  and after composite operators decomposed: the operators that run), less those that launch no
  kernel: views and in-place views (by their schemas), allocations, and two syncs that are
  copies (a scalar read; a blocking copy between host and device). Inside a compiled graph
  only its extern calls (matmuls, custom operators) dispatch; its own kernels are counted from
  torch.profiler's events: Triton's launcher marks each while the profiler runs, and inductor's
  C++ kernels carry a mark when compiled under `kernel_markers()` (without it a CPU graph's
  kernels go uncounted). A Triton kernel that megalite launches in eager mode outside a custom
  operator (CUDA only) is not an ATen operator and is not counted.
- **Host syncs**, by kind:
  - `item`: a scalar read (`_local_scalar_dense`: `.item()`, `bool()`, `int()`, `float()`);
  - `tolist`: `Tensor.tolist`, one read however many elements (on CPU it dispatches nothing, so
    it is counted where Python calls it);
  - `output size`: an operator whose output size depends on the data (schema tag
    `dynamic_output_shape`: `nonzero`, boolean indexing, `repeat_interleave` without
    `output_size`, `unique`, `bincount`...) and `equal`, which returns a Python bool;
  - `copy to host`: a copy from the device to the host that is not `non_blocking`;
  - `copy to device`: a blocking copy onto the device: `torch.tensor` or `torch.as_tensor` of
    Python data with the device named (counted where Python calls them: the copy inside is not
    dispatched), or a `.to(device)` / `copy_` from the host that is not `non_blocking`.

  A tensor is the device's when it is on the step's device type. On a CPU run that is every
  tensor, so a read of what would be a host tensor on a GPU counts, unless the caller names it
  (`counting(host=...)`: torch.optim's step counts), and no copy between host and device
  happens to count (megalite's `.to(device)` of a host tensor is no copy there). Waits on CUDA
  events and streams are not ATen operators and are not counted.
- **Compilation**: graphs compiled in the process and graph breaks by reason (dynamo's
  counters: both are taken while compiling, so a steady step adds none), the compiled graphs
  the step ran, and recompiles while counting.

Counts are by phase. `count_step` runs megalite's `train_step` with a timer that names the
executor's intervals: forward, backward (W steps included), other (the rest of the executor's
run: pipeline messages, receives, the loss sum) and optimizer (everything outside the run:
resetting the gradient buffers, finalize, the loss all-reduce, grad norm, verdict, clipping,
the update, metrics), as `step_timing` cuts a step's time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.data import TokenBatch
from megalite.pipeline.executor import IntervalTimer
from megalite.training.setup import Run
from megalite.training.step import train_step

aten = torch.ops.aten

NO_KERNEL = {
    aten._unsafe_view,  # a view whose schema does not say so
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.empty_permuted,
    aten.new_empty,
    aten.new_empty_strided,
    aten.record_stream,
}
"""Operators whose schema does not mark them as views that still launch nothing: views in all
but name and allocations."""

PHASES = ("forward", "backward", "optimizer", "other")
"""The phases of `count_step`'s counts (the module docstring says what each holds)."""
PHASE_OF_INTERVAL = {
    "forward": "forward",
    "backward": "backward",
    "weight": "backward",
    "run": "other",
}
"""The executor's timer intervals that begin a phase; the others (collectives, receives,
pipeline messages) stay in the phase they happen in."""

PHASE_MARK = "megalite.phase:"
"""torch.profiler's name for a phase, to place compiled kernels in it."""
GRAPH_CALL = "## Call CompiledFxGraph"
"""The start of inductor's name for a compiled graph's run in torch.profiler."""

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass
class PhaseCounts:
    launches: int = 0
    """Operator calls that launch a kernel: eager ATen operators and compiled kernels."""
    compiled_kernels: int = 0
    """Of `launches`: the kernels of compiled graphs (their extern calls are ATen operators)."""
    graph_calls: int = 0
    """Compiled graphs run (a forward and its backward graph count one each)."""
    host_syncs: int = 0


@dataclass
class StepCounts:
    phases: dict[str, PhaseCounts] = field(default_factory=dict)
    sync_sites: dict[str, int] = field(default_factory=dict)
    """`"<kind> at <file>:<line>"` -> syncs: the first frame outside torch that asked."""
    compiled_graphs: int = 0
    """Graphs dynamo has compiled in this process (forward graphs; each has its backward)."""
    graph_breaks: dict[str, int] = field(default_factory=dict)
    """Graph breaks dynamo took in this process, by reason."""
    recompiles: int = 0
    """Graphs compiled while counting, and frames stopped at dynamo's recompile limit: 0 in a
    steady step."""

    @property
    def total(self) -> PhaseCounts:
        """The counts of the whole step."""
        summed = PhaseCounts()
        for counts in self.phases.values():
            for key, value in dataclasses.asdict(counts).items():
                setattr(summed, key, getattr(summed, key) + value)
        return summed


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether a dispatched ATen operator launches a kernel (see the module docstring)."""
    if func.namespace == "profiler" or func.is_view or func.overloadpacket in NO_KERNEL:
        return False
    return not {torch.Tag.inplace_view, torch.Tag.data_dependent_output} & set(func.tags)


def _is_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _copy_sync(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> str | None:
    """The kind of sync a copy between host and device is, or None (not such a copy, or
    `non_blocking`)."""
    if func is aten._to_copy.default:
        source, target, non_blocking = args[0], out, kwargs.get("non_blocking", False)
    elif func is aten.copy_.default:
        target, source = args[:2]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        return None
    if non_blocking or _is_host(source) == _is_host(target):
        return None
    return "copy to host" if _is_host(target) else "copy to device"


def _sizes_from_data(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether the host must read the data to size the output (`output size` syncs)."""
    if func is aten.equal.default:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is aten.index.Tensor:  # only a mask's true count is data
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is aten.one_hot.default:
        return (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) == -1
    return True


def _site() -> str:
    """`file:line` of the innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame.f_back and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    path = os.path.relpath(frame.f_code.co_filename)
    return f"{frame.f_code.co_filename if path.startswith('..') else path}:{frame.f_lineno}"


class Tally(TorchDispatchMode):
    """The counts of a stretch of code (`counting` enters and leaves it). It watches the ATen
    operators dispatched; compiled code runs compiled under it (`ignore_compile_internals`), its
    extern calls dispatched through it."""

    def __init__(
        self, device: torch.device | str, phase: str, host: Iterable[torch.Tensor] = ()
    ) -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self.host = {id(t) for t in host}
        self.phases: dict[str, PhaseCounts] = {}
        self.sites: Counter[str] = Counter()
        self.open = [phase]
        self.paused = 0
        self.counts: StepCounts | None = None
        """What `counting` counted, once its block has ended."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _here(self) -> PhaseCounts:
        return self.phases.setdefault(self.open[-1], PhaseCounts())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside as `name`'s (nested: the innermost phase's)."""
        self.open.append(name)
        try:
            with torch.profiler.record_function(PHASE_MARK + name):
                yield
        finally:
            self.open.pop()

    def sync(self, kind: str) -> None:
        """Count one host sync of `kind` here."""
        self._here().host_syncs += 1
        self.sites[f"{kind} at {_site()}"] += 1

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Count nothing inside (the inside of a sync already counted)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def on_device(self, tensor: Any) -> bool:
        """Whether `tensor` is the device's (not one of the tallied code's host tensors)."""
        if not isinstance(tensor, torch.Tensor) or id(tensor) in self.host:
            return False
        return tensor.device.type == self.device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        if torch.Tag.data_dependent_output in func.tags and self.on_device(args[0]):
            self.sync("item")
        elif (copy := _copy_sync(func, args, kwargs, out)) is not None:
            self.sync(copy)
        elif launches_kernel(func):
            self._here().launches += 1
            if _sizes_from_data(func, args, kwargs) and self.on_device(args[0]):
                self.sync("output size")
        return out

    def add_compiled(self, events: list[Any]) -> None:
        """Add the compiled graphs' runs and kernels among torch.profiler's `events`, each in
        the innermost phase open when it began."""
        marks = [e for e in events if e.name.startswith(PHASE_MARK)]

        def phase_at(event: Any) -> PhaseCounts:
            start = event.time_range.start
            inside = [m for m in marks if m.time_range.start <= start <= m.time_range.end]
            name = max(inside, key=lambda m: m.time_range.start).name if inside else None
            key = name.removeprefix(PHASE_MARK) if name else self.open[0]
            return self.phases.setdefault(key, PhaseCounts())

        for event in events:
            parent = event.cpu_parent
            if event.name.startswith(GRAPH_CALL):
                phase_at(event).graph_calls += 1
            elif parent is not None and parent.name.startswith(GRAPH_CALL):
                if "::" not in event.name:  # an operator (ns::op) dispatched: counted already
                    counts = phase_at(event)
                    counts.launches += 1
                    counts.compiled_kernels += 1


def _device_given(device: Any, tally: Tally) -> bool:
    """Whether a factory's `device` argument names the tallied device type."""
    return device is not None and torch.device(device).type == tally.device_type


@contextlib.contextmanager
def _entry_points_counted(tally: Tally) -> Iterator[None]:
    """The syncs that dispatch nothing to tell them by, counted where Python calls them (one
    sync each; what they dispatch inside is part of it): `Tensor.tolist` of a device tensor,
    which on CPU reads memory directly, and `torch.tensor` / `torch.as_tensor` of Python data
    with the device named, whose copy onto it is not dispatched (and on CPU is no copy)."""
    tolist, tensor, as_tensor = torch.Tensor.tolist, torch.tensor, torch.as_tensor
    own_tolist = "tolist" in vars(torch.Tensor)  # else inherited from the C base class

    def quietly(sync: str | None, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if sync is not None and not tally.paused:
            tally.sync(sync)
        with tally.quiet():
            return call(*args, **kwargs)

    def counted_tolist(self: torch.Tensor) -> Any:
        return quietly("tolist" if tally.on_device(self) else None, tolist, self)

    def counted_tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        copy = "copy to device" if _device_given(kwargs.get("device"), tally) else None
        return quietly(copy, tensor, data, *args, **kwargs)

    def counted_as_tensor(data: Any, dtype: Any = None, device: Any = None) -> torch.Tensor:
        copied = not isinstance(data, torch.Tensor) and _device_given(device, tally)
        return quietly("copy to device" if copied else None, as_tensor, data, dtype, device)

    torch.Tensor.tolist, torch.tensor, torch.as_tensor = (
        counted_tolist,
        counted_tensor,
        counted_as_tensor,
    )
    try:
        yield
    finally:
        if own_tolist:
            torch.Tensor.tolist = tolist
        else:
            del torch.Tensor.tolist  # the base class's shows through again
        torch.tensor, torch.as_tensor = tensor, as_tensor


def _dynamo() -> Any:
    """torch._dynamo if this process imported it (nothing can have compiled otherwise), else
    None: importing it imports Triton (see `training/compile.py`)."""
    return sys.modules.get("torch._dynamo")


def _reason(key: str) -> str:
    """A graph break's reason in one line: dynamo's title and its explanation."""
    lines = [line.strip() for line in key.splitlines()]
    explained = [line.removeprefix("Explanation: ") for line in lines if line.startswith("Expl")]
    return ": ".join(lines[:1] + explained[:1])


def graph_breaks() -> dict[str, int]:
    """Graph breaks dynamo has taken in this process so far, by reason (none if it was never
    imported)."""
    reasons: Counter[str] = Counter()
    if _dynamo() is not None:
        for key, n in _dynamo().utils.counters["graph_break"].items():
            reasons[_reason(key)] += n
    return dict(reasons)


def host_step_counts(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """torch.optim's step counts that stay in host memory on a GPU too (its groups that are
    neither fused nor capturable): reading them makes no device wait (`counting(host=...)`)."""
    return [
        optimizer.state[p]["step"]
        for group in optimizer.param_groups
        if not (group.get("fused") or group.get("capturable"))
        for p in group["params"]
        if torch.is_tensor(optimizer.state.get(p, {}).get("step"))
    ]


def _compile_state() -> tuple[int, int]:
    """(graphs compiled, frames stopped at the recompile limit) in this process so far."""
    from megalite.training.compile import compiled_graphs, recompile_limit_hits

    return (compiled_graphs(), recompile_limit_hits()) if _dynamo() else (0, 0)


@contextlib.contextmanager
def counting(
    device: torch.device | str, phase: str = "step", host: Iterable[torch.Tensor] = ()
) -> Iterator[Tally]:
    """Count the block's launches and host syncs on `device` (outside any inner phase, as
    `phase`'s) and what dynamo compiled meanwhile, into the tally's `counts` when the block
    ends. `host`: tensors that stay in host memory on a GPU too (torch.optim's step counts,
    unless fused or capturable), whose reads a CPU run must not count. Where this process has
    compiled graphs, torch.profiler runs too, to count their kernels."""
    tally = Tally(device, phase, host)
    graphs, stopped = _compile_state()
    profiler: Any = contextlib.nullcontext()
    if graphs:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with profiler as prof, _entry_points_counted(tally), tally:
        yield tally
    if graphs:
        tally.add_compiled(list(prof.events()))
    result = StepCounts(phases=dict(tally.phases), sync_sites=dict(tally.sites))
    result.compiled_graphs, now_stopped = _compile_state()
    result.recompiles = result.compiled_graphs - graphs + now_stopped - stopped
    result.graph_breaks = graph_breaks()
    tally.counts = result


@contextlib.contextmanager
def kernel_markers() -> Iterator[None]:
    """Compile inductor's C++ kernels inside with a torch.profiler mark each (Triton kernels
    have theirs), so that `counting` can count them: what compiles here, forward and backward
    (AOTAutograd compiles a backward at its first run), is counted in later steps. A mark costs
    little while no profiler runs."""
    import torch._inductor.config

    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        yield


class PhaseTimer(IntervalTimer):
    """The executor's timer (`train_step(timer=...)`) telling `tally` the phase that runs: its
    intervals time as they always do."""

    def __init__(self, device: torch.device, tally: Tally) -> None:
        super().__init__(device)
        self.tally = tally

    @contextlib.contextmanager
    def interval(self, name: str) -> Iterator[None]:
        phase = PHASE_OF_INTERVAL.get(name)
        with super().interval(name), self.tally.phase(phase) if phase else contextlib.nullcontext():
            yield


def count_step(run: Run, tokens: TokenBatch | torch.Tensor, lr: float) -> StepCounts:
    """One `train_step` of `run`, counted by phase (the module docstring names them)."""
    with counting(run.ps.device, "optimizer") as tally:
        train_step(run, tokens, lr, timer=PhaseTimer(run.ps.device, tally))
    return tally.counts
