"""One training step, as data flows (docs/architecture.md): micro-batches through the
schedule, gradient fix-ups, overflow check, global norm, the bad-step verdict
(`optimizer/bad_steps.py`), clipping, the optimizer step on this rank's shard."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megalite import comm
from megalite.context_parallel.layout import SequenceCut
from megalite.data.dataset import TokenBatch
from megalite.data_parallel.finalize import finalize_grads
from megalite.optimizer.bad_steps import GOOD
from megalite.optimizer.clip import clip_coefficient
from megalite.pipeline.executor import (
    IntervalTimer,
    MicroBatch,
    StepTimes,
    TimedRun,
    bubble_fraction,
)
from megalite.training.compile import eager
from megalite.training.setup import Run


@dataclass
class StepMetrics:
    loss: float
    """Mean token loss over the whole global batch (the same quantity for every layout)."""
    grad_norm: float
    skipped: bool
    """fp16 overflow: the update was skipped and the loss scale lowered."""
    bubble_fraction: float
    """The papers' pipeline bubble: time the pp ranks waited on receives relative to their
    compute time, summed over the pipeline ((p - 1) / m for a balanced 1F1B schedule)."""
    times: StepTimes
    """This rank's run of the schedule: where its time went, its peak of micro-batches held."""
    bad: str | None = None
    """Why the bad-step policy skipped the update (a NaN loss, a spike); None when it did not."""
    compile_s: float | None = None
    """With `train.compile`: seconds this rank has spent compiling so far (the first step's)."""
    recompiles: int | None = None
    """With `train.compile`: graphs this rank compiled after its first step (should be 0)."""
    expert_imbalance: float | None = None
    """Mixture of experts: the busiest expert's routed tokens over the mean, the largest over
    the layers this rank holds (1.0: perfectly balanced)."""
    dropped_tokens: int | None = None
    """Mixture of experts with a capacity factor: (token, choice) pairs dropped this step, over
    this rank's layers."""
    loss_scale: float = 1.0
    """The loss scale after this step (fp16's moves; 1 otherwise)."""
    skipped_steps: int = 0
    """Steps the fp16 loss scaler has skipped so far."""
    bad_steps: int = 0
    """Bad steps (`optimizer/bad_steps.py`) so far, this one included."""
    bad_in_a_row: int = 0
    """The bad-step streak this step ends (0: it was good)."""


def route_balance(run: Run, skip: torch.Tensor) -> torch.Tensor | None:
    """After the step, the MoE layers' routing over the global batch, in one collective for
    all of them: each layer's bias update (DeepSeek-V3's balancing) unless the step `skip`ped
    its update (a float flag on the device: a skipped step changes no state), and (the
    busiest expert's load over the mean, the worst layer's; (token, choice) pairs dropped) on
    the device, or None without experts. The loads were summed over the token shards (SP, cp)
    as they were counted, and every rank of a replica counted its micro-batches' drops whole
    (`MoE.within_capacity`)."""
    layers = list(run.moe_layers.values())
    if not layers:
        return None
    ps = run.ps
    dropped = torch.stack([layer.dropped for layer in layers])
    stats = torch.cat([torch.stack([layer.load for layer in layers]), dropped[:, None]], dim=1)
    comm.all_reduce(stats, ps.group("dp"))
    updated = 1.0 - skip
    for layer, row in zip(layers, stats):
        layer.take_load(row[:-1], updated)
    load = stats[:, :-1].double()
    worst = (load.amax(dim=1) / load.mean(dim=1).clamp_min(1e-9)).amax().view(1)
    lost = stats[:, -1].sum().view(1).double()
    comm.all_reduce_max(worst, ps.group("pp"))  # over the pipeline's stages
    comm.all_reduce(lost, ps.group("pp"))
    return torch.cat([worst, lost])


def micro_batches(
    batch: TokenBatch | torch.Tensor, micro_batch_size: int, cut: SequenceCut | None = None
) -> list[MicroBatch]:
    """Cut this rank's share into micro-batches: of the halves it read (a middle pipeline stage
    gets micro-batches of neither, only their count). A tensor is whole (n, seq + 1) windows, as
    tests and benchmarks pass them: inputs and shifted targets both. With a `cut` (context
    parallelism, document masking) each micro-batch holds this rank's chunks of its windows
    and their layout."""
    if isinstance(batch, torch.Tensor):
        batch = TokenBatch.of_windows(batch)
    layout = None
    if cut is not None and not cut.plain:
        layout = cut.layout(batch.inputs)
        batch = TokenBatch(batch.size, cut.shard(batch.inputs), cut.shard(batch.targets))

    def rows(half: torch.Tensor | None, start: int) -> torch.Tensor | None:
        return None if half is None else half[start : start + micro_batch_size]

    return [
        MicroBatch(
            rows(batch.inputs, start),
            rows(batch.targets, start),
            None if layout is None else layout.rows(start, micro_batch_size),
        )
        for start in range(0, batch.size, micro_batch_size)
    ]


def global_loss(local: torch.Tensor, run: Run) -> torch.Tensor:
    """Sum the per-rank shares of the mean: over the replicas (dp x cp: each holds some of the
    tokens) and from the last pipeline stage. On the device."""
    comm.all_reduce(local, run.ps.group(*run.ps.dims.replica_axes))
    comm.all_reduce(local, run.ps.group("pp"))
    return local


def on_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host numbers as a float64 tensor on `device`, copied without making the host wait (from
    pinned memory, on a GPU)."""
    host = torch.tensor(values, dtype=torch.float64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def train_step(
    run: Run, tokens: TokenBatch | torch.Tensor, lr: float, timer: IntervalTimer | None = None
) -> StepMetrics:
    """tokens: this rank's share of the global batch on its device (`loop.rank_batch`), or its
    data-parallel slice as whole (n, seq + 1) windows. `timer`: the profiler's, which the
    pipeline executor then times into (`profiling/step_timing.py`). The step runs without
    waiting for the device (`launch_step`); its metrics then come to the host (`read`)."""
    return launch_step(run, tokens, lr, timer).read()


def launch_step(
    run: Run, tokens: TokenBatch | torch.Tensor, lr: float, timer: IntervalTimer | None = None
) -> LaunchedStep:
    """The step as the device runs it, with nothing read back: the loss, the norm, the loss
    scaler's and the bad-step policy's verdicts stay on the device, and so does the decision
    to skip the update (the optimizer applies it as a flag). A GPU never waits for the host."""
    cfg = run.cfg
    run.train(True)
    for buffer in run.buffers:
        buffer.reset()
    batches = micro_batches(tokens, cfg.train.micro_batch_size, run.sequence_cut)
    loss_weight = 1.0 / (cfg.train.global_batch_size * cfg.model.seq_len)
    scale = run.scaler.factor(run.ps.device)  # this step's; update() moves it
    # a micro-batch's auxiliary losses (MoE routers) weigh what its token losses weigh
    share = cfg.train.micro_batch_size / cfg.train.global_batch_size
    for layer in run.moe_layers.values():
        layer.scale_aux_loss(share * scale)
    local_loss, timed = run.executor.run(
        run.schedule(len(batches)), batches, loss_weight, scale, timer
    )
    finalize_grads(run.buffers, run.ps)

    loss = global_loss(local_loss, run)
    skipped = excused = None
    if run.scaler.dynamic:
        skipped = run.scaler.update(run.optimizer.found_non_finite())
        # an fp16 overflow the scaler skips is routine, not a bad step; a loss that is not
        # finite is bad all the same
        excused = (skipped > 0) & loss.isfinite()
    grad_norm = run.optimizer.grad_norm()
    grad_norm = grad_norm / scale if run.scaler.dynamic else grad_norm
    verdict = run.bad_steps.judge(loss, grad_norm, run.ps, excused)
    bad = (verdict[0] != GOOD).to(torch.float32)
    skip = bad if skipped is None else torch.maximum(bad, skipped.float())
    coefficient = clip_coefficient(grad_norm, cfg.optim.grad_clip)
    grad_scale = coefficient / scale if run.scaler.dynamic else coefficient
    run.optimizer.step(lr, grad_scale=grad_scale, skip=skip)
    routing = route_balance(run, skip)
    watched = None
    if run.compile_watch is not None:
        run.compile_watch.step_done()
        # the slowest rank's compile time, and recompiles on any rank (rank 0 logs them)
        watch = run.compile_watch
        watched = on_device([watch.seconds, watch.recompiles], run.ps.device)
        comm.all_reduce_max(watched, run.ps.world_group)
    packed = [
        loss.double().view(1),
        grad_norm.double().view(1),
        verdict,
        run.scaler.state[::2],  # the scale after this step, the steps it skipped
        run.bad_steps.counters[:2],  # bad steps in total and in a row, for the loop's hooks
    ]
    packed += [] if skipped is None else [skipped.view(1)]  # this step's fp16 overflow
    packed += [] if routing is None else [routing]
    packed += [] if watched is None else [watched]
    return LaunchedStep(torch.cat(packed), timed, run, routing is not None, watched is not None)


@dataclass
class LaunchedStep:
    """A step the device may still be running: its metrics, packed in one tensor there."""

    packed: torch.Tensor
    timed: TimedRun
    run: Run
    routed: bool
    compiled: bool

    def read(self) -> StepMetrics:
        """The metrics on the host (`read_steps` of this step alone). Collective over the pp
        group."""
        return read_steps([self])[0]


def read_steps(steps: list[LaunchedStep]) -> list[StepMetrics]:
    """The metrics of steps launched one after another on the host: one copy from the device
    for all of them (a wait for the last one's end), then (pp > 1) their pipeline bubbles from
    every stage's timings in a second. The host mirrors of the bad-step counters are the last
    step's. Collective over the pp group."""
    run = steps[0].run
    rows = torch.stack([step.packed for step in steps]).tolist()
    times = [step.timed.times() for step in steps]
    wait_and_compute = [[t.wait_s, t.compute_s] for t in times]
    if run.ps.size("pp") > 1:  # the whole pipeline's (one stage's is all it has)
        summed = on_device(sum(wait_and_compute, []), run.ps.device)
        comm.all_reduce(summed, run.ps.group("pp"))
        wait_and_compute = summed.view(-1, 2).tolist()
    run.bad_steps.saw(rows[-1][7:9])
    return [
        _metrics(step, values, t, bubble_fraction(*pair))
        for step, values, t, pair in zip(steps, rows, times, wait_and_compute)
    ]


def _metrics(
    step: LaunchedStep, values: list[float], times: StepTimes, bubble: float
) -> StepMetrics:
    """A step's metrics from its packed values (`launch_step`'s order) on the host."""
    loss, grad_norm, *verdict = values[:5]
    scale, skipped_steps = values[5:7]
    bad_total, bad_in_a_row = values[7:9]
    rest = values[9:]
    overflowed = False
    if step.run.scaler.dynamic:
        overflowed, rest = rest[0] > 0, rest[1:]
    bad = step.run.bad_steps.describe(verdict, loss)
    metrics = StepMetrics(loss, grad_norm, overflowed, bubble, times, bad)
    metrics.loss_scale, metrics.skipped_steps = scale, int(skipped_steps)
    metrics.bad_steps, metrics.bad_in_a_row = int(bad_total), int(bad_in_a_row)
    if step.routed:
        metrics.expert_imbalance, metrics.dropped_tokens = rest[0], int(rest[1])
        rest = rest[2:]
    if step.compiled:
        metrics.compile_s, metrics.recompiles = rest[0], int(rest[1])
    return metrics


@torch.no_grad()
def eval_loss(run: Run, batch: TokenBatch) -> float:
    """Mean token loss of `batch` (this rank's share of an evaluation batch)."""
    run.train(False)
    batches = micro_batches(batch, run.cfg.train.micro_batch_size, run.sequence_cut)
    total_tokens = batch.size * run.ps.size("dp") * run.cfg.model.seq_len
    compiled = run.compile_watch is not None
    with eager() if compiled else contextlib.nullcontext():  # no graphs for a few batches
        schedule = run.schedule(len(batches), True)
        local_loss, _ = run.executor.run(schedule, batches, 1.0 / total_tokens)
    return global_loss(local_loss, run).item()
