"""A throughput model of one training step for a layout, for `megalite plan` to rank layouts.

Compute is the FLOPs of each pipeline stage (`partition.stage_costs`: embedding, head and
recompute included) at a fraction of the device's peak. Communication is message size over link
bandwidth (ring collectives): tensor parallelism's all-reduces, or all-gathers and
reduce-scatters under sequence parallelism, two each way per layer and micro-batch, exposed;
pipeline p2p, exposed while the pipeline fills and drains; data parallelism's gradient
reduce-scatter (all-reduce without ZeRO), overlapped with the last micro-batch's backward (with
ZeRO-2 each micro-batch's with its own), and ZeRO's parameter all-gather, overlapped with the
next step's first forward; every message also costs the link's latency. The pipeline's
makespan, bubble included, comes from the schedule simulator with the actual stage costs.

On GPUs each rank owns its device, so the step takes as long as its critical path. CPU ranks on
one machine share its cores (one thread each): the machine's measured peak is divided among the
ranks that are busy, and a rank that waits in a bubble frees its core for another (in part:
`Machine.bubble_lent`), so the step takes the longer of the critical path at one core per rank
and all ranks' work spread over the cores. On CPU gloo moves messages with the cores too, so
communication counts as work there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megalite.config import Config
from megalite.models.partition import rank_stages, stage_costs, stage_ranges
from megalite.parallel_dims import ParallelDims
from megalite.pipeline.schedule import build_schedule, check_microbatches, v_shaped
from megalite.pipeline.simulate import simulate
from megalite.profiling.estimate import ELEMENT_BYTES, resolve_precision
from megalite.profiling.parameters import stage_parameters

OPTIMIZER_BYTES_PER_PARAM = 28
"""AdamW reads param, grad, m, v and writes param, m, v: seven fp32 values per parameter."""


@dataclass(frozen=True)
class Machine:
    """The hardware a layout runs on."""

    device: str
    """cuda or cpu."""
    world_size: int
    nodes: int
    memory_bytes: float
    """Per rank: one GPU's memory, or the machine's RAM divided among the CPU ranks."""
    peak_flops: float
    """Dense peak FLOP/s of one GPU, or of the whole CPU machine (all its cores)."""
    mfu_fraction: float
    """Fraction of the peak the layers' matmuls reach."""
    intra_node_bandwidth: float
    """Bytes/s one rank moves to another in its node (on CPU: what gloo copies per second)."""
    inter_node_bandwidth: float
    """Bytes/s one rank moves across nodes."""
    memory_bandwidth: float
    """Bytes/s of the optimizer's elementwise update on one rank."""
    layer_overhead_s: float
    """Seconds a rank spends per layer and micro-batch (forward + backward) beyond its FLOPs:
    dispatch and kernel launches, which neither tp nor a larger micro-batch divides."""
    latency_s: float
    """Seconds each collective or p2p message costs whatever its size: the link's latency,
    and on CPU ranks that outnumber the cores, waiting for the peer to be scheduled."""
    split_collective_cost: float = 1.0
    """A reduce-scatter's or all-gather's time relative to a ring's, (n - 1) / n of the bytes
    over the link: 1 for NCCL; gloo's take about twice that (8 CPU ranks, 21 MB: all-reduce
    0.20 s, reduce-scatter 0.16 s, all-gather 0.25 s), so ZeRO's pair costs two all-reduces."""
    cores: int = 1
    """CPU cores the ranks share (cpu only)."""
    bubble_lent: float = 1.0
    """CPU only: the share of a waiting rank's core time that the job's busy ranks get. All
    of it on a machine of its own; less where the OS gives it to other work or a waking rank
    takes its time (8 gloo ranks on a 2-core machine that other jobs kept busy: about 0.6)."""

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def bandwidth(self, span: int) -> float:
        """Link bandwidth of a group whose ranks lie within `span` consecutive ranks."""
        return (
            self.intra_node_bandwidth if span <= self.ranks_per_node else self.inter_node_bandwidth
        )

    @property
    def rank_flops(self) -> float:
        """FLOP/s one rank computes at: its GPU's, or one core's share of the CPU's."""
        share = self.cores if self.device == "cpu" else 1
        return self.peak_flops * self.mfu_fraction / share


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds per step and the terms that make them (per step, on the critical
    rank, exposed unless said otherwise)."""

    step_s: float
    tokens_per_s: float
    pipeline_s: float
    """Makespan of the schedule: compute and tp communication of every micro-batch, bubble
    included."""
    bubble: float
    """Idle share of the pipeline's makespan (1 - busy / (pp * makespan))."""
    tp_comm_s: float
    """Tensor-parallel collectives of the busiest pipeline rank (inside pipeline_s)."""
    p2p_s: float
    dp_comm_s: float
    optimizer_s: float
    latency_s: float
    """Every collective and message of the critical rank at the link's latency."""
    cpu_bound: bool
    """CPU only: the shared cores, not the critical path, set the step time."""


def per_rank(cfg: Config, per_stage: list[float]) -> list[float]:
    """Sums of a per-virtual-stage quantity over each pipeline rank's chunks."""
    return [sum(per_stage[s] for s in stages) for stages in rank_stages(cfg)]


def predict(cfg: Config, machine: Machine) -> Prediction:
    """Seconds per step of `cfg`'s layout on `machine` (see the module docstring)."""
    p, t = cfg.parallel, cfg.train
    dp, m = cfg.layout_for_world(machine.world_size)
    dims = p.dims(machine.world_size)
    element = ELEMENT_BYTES[resolve_precision(t.precision, machine.device)]
    act = t.micro_batch_size * cfg.model.seq_len * cfg.model.hidden * element  # one mb's x
    forward, backward, tp_s, tp_calls = _stage_times(cfg, machine, dims, act)
    makespan, bubble = pipeline_makespan(cfg, m, forward, backward)
    tp_per_rank = [m * s for s in per_rank(cfg, tp_s)]
    calls = max(m * c for c in per_rank(cfg, tp_calls))

    # pp: an activation forward and a gradient back per boundary, exposed along fill and drain
    message = act / (p.tp if p.sp else 1) / machine.bandwidth(dims.span("pp"))
    boundaries = p.pp * p.vpp - 1
    p2p = 2 * boundaries * message
    calls += 2 * (boundaries + m) if p.pp > 1 else 0

    params = max(stage_parameters(cfg, r) for r in range(p.pp))
    dp_bw = machine.bandwidth(dims.span("dp"))
    split = machine.split_collective_cost
    grads = (dp - 1) / dp * params * 4 / dp_bw  # fp32 main grads, reduce-scattered
    gather = split * (dp - 1) / dp * params * element / dp_bw if p.zero else 0.0
    # reduce-scattered under the last micro-batch's backward (ZeRO-2: under each one's), an
    # all-reduce without ZeRO; the parameter all-gather under the next step's first forward
    rounds = m if p.zero == 2 else 1
    reduce = rounds * grads * (split if p.zero else 2)
    window = rounds * max(per_rank(cfg, backward))
    first_forward = min(per_rank(cfg, forward))
    dp_s = max(0.0, reduce - window) + max(0.0, gather - first_forward)
    buckets = math.ceil(params * 4 / (p.bucket_mb * 2**20))
    calls += buckets * (rounds + (p.zero > 0)) if dp > 1 else 0
    optimizer = params / (dp if p.zero else 1) * OPTIMIZER_BYTES_PER_PARAM
    optimizer /= machine.memory_bandwidth

    step, cpu_bound = makespan + p2p + dp_s + optimizer, False
    if machine.device == "cpu":  # the ranks' work over the shared cores, if that is longer
        compute = m * (sum(forward) + sum(backward))  # the pp ranks together
        p2p_work = 4 * m * boundaries * message  # both ends copy every message
        work = p.tp * dp * (compute + p2p_work + p.pp * (reduce + gather + optimizer))
        shared = work / min(machine.cores, machine.world_size)
        shared *= 1 + (1 - machine.bubble_lent) * bubble  # the bubble time not lent is lost
        cpu_bound, step = shared > step, max(step, shared)
    step += calls * machine.latency_s  # the ranks meet at every message: nothing hides it
    return Prediction(
        step_s=step,
        tokens_per_s=t.global_batch_size * cfg.model.seq_len / step,
        pipeline_s=makespan,
        bubble=bubble,
        tp_comm_s=max(tp_per_rank),
        p2p_s=p2p,
        dp_comm_s=dp_s,
        optimizer_s=optimizer,
        latency_s=calls * machine.latency_s,
        cpu_bound=cpu_bound,
    )


def _stage_times(
    cfg: Config, machine: Machine, dims: ParallelDims, act: float
) -> tuple[list[float], list[float], list[float], list[int]]:
    """Per virtual stage and micro-batch: forward and backward seconds (FLOPs, tp transfers,
    per-layer overhead), the tp transfer seconds among them, and the tp collectives called."""
    p, tokens = cfg.parallel, cfg.train.micro_batch_size * cfg.model.seq_len
    # per layer pass: two all-reduces, or two all-gathers and two reduce-scatters under sp
    per_pass = 0 if p.tp == 1 else 4 if p.sp else 2
    # all-reduces or sp's all-gathers and reduce-scatters: the same bytes either way
    transfer = 4 * (p.tp - 1) / p.tp * act / machine.bandwidth(dims.span("tp"))
    transfer *= machine.split_collective_cost if p.sp else 1.0
    forward, backward, tp_s, tp_calls = [], [], [], []
    for cost, layers, rerun in zip(stage_costs(cfg), stage_ranges(cfg), _recomputed_layers(cfg)):
        tp_f, tp_b = len(layers) * transfer, (len(layers) + rerun) * transfer
        fixed = len(layers) * machine.layer_overhead_s / 3  # a third forward, two backward
        forward.append(cost.forward * tokens / p.tp / machine.rank_flops + tp_f + fixed)
        backward.append(cost.backward * tokens / p.tp / machine.rank_flops + tp_b + 2 * fixed)
        tp_s.append(tp_f + tp_b)
        tp_calls.append((2 * len(layers) + rerun) * per_pass)
    return forward, backward, tp_s, tp_calls


def _recomputed_layers(cfg: Config) -> list[int]:
    """Layers per virtual stage whose forward (and its tp collectives) backward runs again."""
    t = cfg.train
    ranges = stage_ranges(cfg)
    if t.recompute not in ("full", "segments"):
        return [0] * len(ranges)
    limit = t.recompute_layers if t.recompute == "full" else None
    return [len(r) if limit is None else min(limit, len(r)) for r in ranges]


def pipeline_makespan(
    cfg: Config, m: int, forward: list[float], backward: list[float]
) -> tuple[float, float]:
    """(seconds from the first forward to the last backward, idle share) of the schedule with
    these per-stage costs. The simulator runs on the stages' relative FLOPs (the same for every
    tp and micro-batch size, so layouts share simulations), scaled to these seconds; a long
    schedule is simulated with fewer micro-batches and extended by the busiest rank's steady
    state, which is what the added micro-batches run at."""
    p = cfg.parallel
    if p.pp == 1:
        return m * (forward[0] + backward[0]), 0.0
    rank_cost = [f + b for f, b in zip(per_rank(cfg, forward), per_rank(cfg, backward))]
    flops = stage_costs(cfg)
    unit = max(max(c.forward, c.backward) for c in flops)
    seconds_per_unit = sum(forward + backward) / sum(c.forward + c.backward for c in flops) * unit
    shorter = _simulated_microbatches(cfg, m)
    span = _simulated_makespan(
        p.schedule,
        p.pp,
        p.vpp,
        shorter,
        p.microbatch_group_size,
        tuple(round(c.forward / unit, 3) for c in flops),
        tuple(round(c.backward / unit, 3) for c in flops),
        tuple(round(c.weight / unit, 3) for c in flops),
    )
    makespan = span * seconds_per_unit + (m - shorter) * max(rank_cost)
    return makespan, 1 - m * sum(rank_cost) / (p.pp * makespan)


def _simulated_microbatches(cfg: Config, m: int) -> int:
    """m, or fewer when m is large: the first valid count from pp on (the steady state starts
    once every stage has a micro-batch; zb-v's once 2 pp - 1 have filled its V)."""
    p = cfg.parallel
    group = p.microbatch_group_size or p.pp
    for shorter in range(2 * p.pp if v_shaped(p.schedule) else p.pp, m):
        if shorter % group == 0:
            check_microbatches(p.schedule, p.pp, shorter, p.vpp, p.microbatch_group_size)
            return shorter
    return m


@functools.lru_cache(maxsize=4096)
def _simulated_makespan(
    kind: str,
    pp: int,
    vpp: int,
    m: int,
    group: int | None,
    forward: tuple[float, ...],
    backward: tuple[float, ...],
    weight: tuple[float, ...],
) -> float:
    """The simulator's makespan (cached: layouts share schedules and relative stage costs)."""
    schedules = [build_schedule(kind, pp, rank, m, vpp, group) for rank in range(pp)]
    costs = (list(forward), list(backward), 0.0, list(weight))
    return simulate(schedules, pp, vpp, *costs, v_shape=v_shaped(kind)).makespan
