"""Runs one rank's schedule: a loop over its steps, with no schedule logic of its own.

Forward of micro-batch m on local chunk c feeds it token ids (first virtual stage) or the
activation received from the previous stage, and keeps (input, output) until the backward.
The p2p actions between two compute steps are posted as one batch (`schedule.p2p_batches`);
a compute waits only for the receive it needs, and that waiting is the measured pipeline bubble.
An output is freed as soon as its send is posted: the backward needs only its autograd graph,
and the communication library holds the sent tensor until the send completes (gloo's work
object, NCCL's stash); Megatron-LM's deallocate_output_tensor. (A gloo send reports completion
only once waited on, so on CPU the sent tensors of a step are held until its end.) Where two
consecutive stages are chunks of this rank (the middle of zb-v's V), the output and its
gradient are handed over in memory instead.
A schedule with W steps splits the backward: its B opens the model's `deferred.Deferral`
(`chunk.ctx.deferral`, which its linears were built with) on the (micro-batch, chunk)'s queue,
so the linears leave their weight gradients, and the gradient buffers the arrival of every
gradient, to the (micro-batch, chunk)'s W step, which is then the step that completes its gradients.
With pp = 1 the schedule holds only forwards and backwards: plain gradient accumulation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megalite import comm
from megalite.context_parallel.layout import SequenceLayout
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.parallel_state import ParallelState
from megalite.pipeline.schedule import Action, Op, p2p_batches, peer_of, virtual_stage
from megalite.tensor_parallel.deferred import WeightGradQueue


@dataclass
class StepTimes:
    """Where one run of a schedule spent its time on this rank (seconds, each part exclusive of
    the others: a collective inside a forward counts under `comm_s`, not `forward_s`)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    weight_s: float = 0.0
    """Of backward_s: the W steps of a split backward (their weight gradients)."""
    wait_s: float = 0.0
    """Waiting for the activation or gradient a compute needs: the measured pipeline bubble."""
    p2p_s: float = 0.0
    """Posting sends and receives, and waiting for the last sends to complete."""
    comm_s: float = 0.0
    """Blocked in collectives issued by the forwards and backwards (tensor parallelism, the dp
    gradient reduction); recorded only while a profiler times collectives into the run's
    timer, else 0."""
    total_s: float = 0.0
    """The whole run: the parts above plus the executor's own bookkeeping."""
    peak_in_flight: int = 0
    """Most (micro-batch, chunk) activations held at once (what the simulator predicts)."""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self.wait_s, self.compute_s)


def bubble_fraction(wait_s: float, compute_s: float) -> float:
    """The papers' bubble: idle time relative to compute time, wait / compute ((p - 1) / m for a
    balanced 1F1B pipeline, (p - 1) / (v m) interleaved; `SimResult.bubble_ratio`)."""
    return wait_s / compute_s if compute_s else 0.0


@dataclass
class _Interval:
    name: str
    start: Any
    """perf_counter seconds on CPU, a recorded CUDA event on a GPU."""
    parent: int | None
    """Index of the interval this one is nested in."""
    end: Any = None


class IntervalTimer:
    """Total time of named intervals: CUDA events on a GPU, the host clock on CPU.

    On a GPU the host only queues kernels, so a host clock would time the queueing, and a wait
    for a receive (which makes the stream wait, not the host) would read zero. There, events are
    recorded on the current stream around each interval and read once, when `totals` is called
    at the end of the step: no synchronisation in between.

    Intervals nest: time inside an inner interval counts for the inner name only (a profiler's
    self time), so the totals of all names add up to the outermost intervals' time.
    """

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.intervals: list[_Interval] = []
        self.open: list[int] = []
        self.last_mark: Any = None

    def _mark(self) -> Any:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.last_mark = event
        return event

    @contextlib.contextmanager
    def interval(self, name: str) -> Iterator[None]:
        parent = self.open[-1] if self.open else None
        self.open.append(len(self.intervals))
        interval = _Interval(name, self._mark(), parent)
        self.intervals.append(interval)
        try:
            yield
        finally:
            interval.end = self._mark()
            self.open.pop()

    def totals(self) -> dict[str, float]:
        """Self seconds per name (closed intervals only). On a GPU this waits for the last
        recorded event: events on one stream complete in order, so every interval has been
        timed then."""
        if self.on_cuda and self.last_mark is not None:
            self.last_mark.synchronize()
        elapsed = [self._elapsed(i) if i.end is not None else 0.0 for i in self.intervals]
        own = list(elapsed)
        for interval, seconds in zip(self.intervals, elapsed):
            if interval.parent is not None:
                own[interval.parent] -= seconds
        totals: dict[str, float] = {}
        for interval, seconds in zip(self.intervals, own):
            if interval.end is not None:
                totals[interval.name] = totals.get(interval.name, 0.0) + seconds
        return totals

    def _elapsed(self, interval: _Interval) -> float:
        if not self.on_cuda:
            return interval.end - interval.start
        return interval.start.elapsed_time(interval.end) / 1000  # ms -> s


@dataclass
class MicroBatch:
    inputs: torch.Tensor | None
    """Token ids (b, s); None on a rank without the first virtual stage (it never reads them)."""
    targets: torch.Tensor | None
    """Next-token ids (b, s); None on a rank without the last virtual stage."""
    layout: SequenceLayout | None = None
    """Which pieces of the windows this rank holds and their documents (every stage needs it
    for attention); None for whole windows of one document each."""


@dataclass
class _Step:
    """What one run of a schedule keeps between actions."""

    micro_batches: list[MicroBatch]
    loss_weight: float
    loss_scale: torch.Tensor | float
    device: torch.device
    timer: IntervalTimer
    split: bool
    """The schedule has W steps: B defers the weight gradients to them."""
    peak_in_flight: int = 0
    received: dict = field(default_factory=dict)
    """(op, micro-batch, chunk) of a receive -> (the batch it was posted in, the buffer it
    fills): the buffer is ready once the whole batch has completed."""
    saved: dict = field(default_factory=dict)
    """(micro-batch, chunk) -> (input, output) kept from forward until backward."""
    input_grads: dict = field(default_factory=dict)
    """(micro-batch, chunk) -> gradient of the chunk's input, until it is sent."""
    handed: dict = field(default_factory=dict)
    """(op, micro-batch, chunk) -> the input that a chunk of this rank handed to `chunk` (an
    activation for its forward, an output gradient for its backward)."""
    deferred: dict = field(default_factory=dict)
    """(micro-batch, chunk) -> the WeightGradQueue its B left for its W."""
    sends: list = field(default_factory=list)
    """Batches with sends not yet seen complete (their works hold the sent tensors)."""

    def __post_init__(self) -> None:
        self.loss_total = torch.zeros((), dtype=torch.float32, device=self.device)


@dataclass
class TimedRun:
    """A run's timer, read only when asked (`times`): on a GPU its events are read once the
    device has run them, so a step need not wait for its schedule's end before the update."""

    timer: IntervalTimer
    peak_in_flight: int

    def times(self) -> StepTimes:
        """StepTimes from the run's self times per interval name ("run" holds the bookkeeping);
        on a GPU, a wait for the device to reach the run's last interval."""
        seconds = self.timer.totals()
        return StepTimes(
            forward_s=seconds.get("forward", 0.0),
            backward_s=seconds.get("backward", 0.0) + seconds.get("weight", 0.0),
            weight_s=seconds.get("weight", 0.0),
            wait_s=seconds.get("wait", 0.0),
            p2p_s=seconds.get("p2p", 0.0),
            comm_s=seconds.get("comm", 0.0),
            total_s=sum(seconds.values()),
            peak_in_flight=self.peak_in_flight,
        )


def _run_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward through `output`'s graph even if its storage was freed after sending it on."""
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True
    )


@dataclass
class PipelineExecutor:
    chunks: list[nn.Module]
    """This rank's model chunks, by local chunk index."""
    ps: ParallelState
    vpp: int
    activation_shape: tuple[int, ...]
    """(micro batch, local seq, hidden) of the tensors exchanged between stages."""
    dtype: torch.dtype
    buffers_of_chunk: list[list[GradBuffer]] = field(default_factory=list)
    """Gradient buffers of each chunk, told to start their dp reduction before the step that
    completes the chunk's last gradients (B, or W under a split backward); ZeRO-2: to finish
    each such step's reductions after it."""
    v_shape: bool = False
    """The chunks lie in a V (zb-v): local chunk 1 is virtual stage 2P - 1 - p."""

    def __post_init__(self) -> None:
        n_stages = self.ps.size("pp") * self.vpp
        rank, size = self.ps.coord("pp"), self.ps.size("pp")
        stages = [virtual_stage(rank, c, size, self.v_shape) for c in range(self.vpp)]
        self.is_first = [s == 0 for s in stages]
        self.is_last = [s == n_stages - 1 for s in stages]
        # the local chunk each chunk's output feeds / input comes from, if it is on this rank
        local = {stage: chunk for chunk, stage in enumerate(stages)}
        self.feeds = [local.get(s + 1) for s in stages]
        self.fed_by = [local.get(s - 1) for s in stages]

    def _peer(self, action: Action) -> int:
        ps = self.ps
        peer_rank, _ = peer_of(action, ps.coord("pp"), ps.size("pp"), self.vpp, self.v_shape)
        return ps.ranks("pp")[peer_rank]

    def run(
        self,
        schedule: list[Action],
        micro_batches: list[MicroBatch],
        loss_weight: float,
        loss_scale: torch.Tensor | float = 1.0,
        timer: IntervalTimer | None = None,
    ) -> tuple[torch.Tensor, TimedRun]:
        """Run the actions of `schedule` (forward-only ones for evaluation, under no_grad);
        returns the sum over this rank's micro-batches of loss_weight * token-loss sum (zero off
        the last stage) and its timer, to be read later. `timer`: the caller's (a profiler that
        also times the rest of the step into it); by default one of the run's own."""
        timer = IntervalTimer(self.ps.device) if timer is None else timer
        split = any(a.op is Op.WEIGHT for a in schedule)
        step = _Step(micro_batches, loss_weight, loss_scale, self.ps.device, timer, split)
        completing = Op.WEIGHT if split else Op.BACKWARD  # completes a micro-batch's gradients
        last = {a.chunk: a for a in schedule if a.op is completing}
        with timer.interval("run"):
            for action in p2p_batches(schedule):
                if not isinstance(action, Action):
                    with timer.interval("p2p"):
                        self._post(step, action)
                    continue
                inputs = self._input(step, action)
                if action.op is Op.FORWARD:
                    with timer.interval("forward"):
                        step.loss_total += self._forward(step, action, inputs)
                    step.peak_in_flight = max(step.peak_in_flight, len(step.saved))
                    continue
                buffers = self.buffers_of_chunk[action.chunk]
                with timer.interval("backward" if action.op is Op.BACKWARD else "weight"):
                    if action == last[action.chunk]:
                        for buffer in buffers:
                            buffer.start_sync()
                    if action.op is Op.BACKWARD:
                        self._backward(step, action, inputs)
                    else:
                        step.deferred.pop((action.microbatch, action.chunk)).run()
                    if action.op is completing:
                        for buffer in buffers:
                            buffer.end_backward()
            with timer.interval("p2p"):
                for batch in step.sends:
                    batch.wait()
        return step.loss_total, TimedRun(timer, step.peak_in_flight)

    def _post(self, step: _Step, batch: tuple[Action, ...]) -> None:
        """Post one batch of sends and receives together (see `schedule._place_p2p` for why this
        cannot deadlock under NCCL), then free the sent outputs' storage."""
        sends, outputs, receives = [], [], []
        for action in batch:
            key = (action.microbatch, action.chunk)
            if action.op is Op.SEND_FORWARD:
                held = step.saved[key] if torch.is_grad_enabled() else step.saved.pop(key)
                outputs.append(held[1])
                message = held[1].detach().contiguous()  # SP shards can be strided views
                sends.append((message, self._peer(action)))
            elif action.op is Op.SEND_BACKWARD:
                sends.append((step.input_grads.pop(key).contiguous(), self._peer(action)))
            else:
                buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=step.device)
                receives.append((action, buffer))
        posted = comm.post_p2p(
            sends, [(buffer, self._peer(a)) for a, buffer in receives], self.ps.group("pp")
        )
        for action, buffer in receives:
            step.received[(action.op, action.microbatch, action.chunk)] = (posted, buffer)
        for output in outputs:
            output.data = torch.empty(0, dtype=output.dtype, device=output.device)
        step.sends = [batch for batch in step.sends if not batch.is_completed()]
        if sends:
            step.sends.append(posted)

    def _input(self, step: _Step, action: Action) -> torch.Tensor | None:
        """The activation (forward) or output gradient (backward) `action` consumes: handed
        over by a chunk of this rank, or received and waited for (the bubble); None for W and
        where the chunk's input comes from neither."""
        handed = step.handed.pop((action.op, action.microbatch, action.chunk), None)
        if handed is not None or action.op is Op.WEIGHT:
            return handed
        receive = Op.RECV_FORWARD if action.op is Op.FORWARD else Op.RECV_BACKWARD
        posted = step.received.pop((receive, action.microbatch, action.chunk), None)
        if posted is None:
            return None
        batch, buffer = posted
        with step.timer.interval("wait"):
            batch.wait()
        return buffer

    def _forward(self, step: _Step, action: Action, received: torch.Tensor | None) -> torch.Tensor:
        mb, c = action.microbatch, action.chunk
        batch = step.micro_batches[mb]
        if self.is_first[c]:
            inputs = batch.inputs
        else:
            inputs = received.requires_grad_(torch.is_grad_enabled())
        output = self.chunks[c](inputs, batch.targets if self.is_last[c] else None, batch.layout)
        if self.is_last[c]:
            output = output * step.loss_weight  # the token-loss sum: this micro-batch's share
        if self.feeds[c] is not None:
            step.handed[(Op.FORWARD, mb, self.feeds[c])] = output.detach()
        if torch.is_grad_enabled():
            step.saved[(mb, c)] = (None if self.is_first[c] else inputs, output)
        elif self.feeds[c] is None:
            step.saved[(mb, c)] = (None, output.detach())  # kept only until it is sent on
        return output.detach() if self.is_last[c] else output.new_zeros((), dtype=torch.float32)

    def _backward(self, step: _Step, action: Action, grad: torch.Tensor | None) -> None:
        mb, c = action.microbatch, action.chunk
        inputs, output = step.saved.pop((mb, c))
        queue = WeightGradQueue() if step.split else None
        deferral = self.chunks[c].ctx.deferral
        with contextlib.nullcontext() if queue is None else deferral.deferring(queue):
            if self.is_last[c]:
                (output * step.loss_scale).backward()
            else:
                _run_backward(output, grad)
        if queue is not None:
            step.deferred[(mb, c)] = queue
        if self.fed_by[c] is not None:
            step.handed[(Op.BACKWARD, mb, self.fed_by[c])] = inputs.grad
        elif inputs is not None:
            step.input_grads[(mb, c)] = inputs.grad
