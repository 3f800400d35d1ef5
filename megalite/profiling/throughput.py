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

Context parallelism (cp ranks) leaves each rank seq_len / cp tokens of every window, and as
much of the causal attention's work (the chunks are balanced): a rank's FLOPs, tp and pp
messages are those of its tokens. Its gradients are reduced, and ZeRO shards, over dp x cp. Its
attention reaches the other chunks' keys and values (`cp_transfers`): the ring (p2p) passes a
K/V block of 2 x b x (s/cp) x kv heads x head_dim elements on at each of cp - 1 steps of a
layer's forward, and in backward the K/V blocks again plus an fp32 dK/dV block at each of cp
steps; each step's transfer runs beside that step's share (1/cp) of the layer's attention
FLOPs, both directions of the link at once, so only what a transfer takes beyond its step's
compute is exposed, and the last dK/dV block's trip home in full. All-gather sends the whole
window's K/V in one collective forward, again backward with a reduce-scatter of the fp32 dK/dV,
none of it overlapped.

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
from megalite.models.flops import mean_attention_flops
from megalite.models.partition import rank_stages, stage_costs, stage_ranges
from megalite.parallel_dims import ParallelDims
from megalite.pipeline.schedule import build_schedule, check_microbatches, v_shaped
from megalite.pipeline.simulate import simulate
from megalite.profiling.estimate import ELEMENT_BYTES, resolve_precision
from megalite.profiling.parameters import dense_shards, stage_parameters

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

    def within_node(self, span: int) -> bool:
        """Whether every group of an axis whose groups lie in blocks of `span` consecutive ranks
        (`ParallelDims.span`, blocks starting at multiples of it) stays inside one node: only if
        the blocks tile the node. A block of a node's size or less that does not (tp 4 on nodes
        of 6) straddles two nodes, and so does one of its groups."""
        return self.ranks_per_node % span == 0

    def bandwidth(self, span: int) -> float:
        """Link bandwidth of a group whose ranks lie within blocks of `span` consecutive ranks."""
        return self.intra_node_bandwidth if self.within_node(span) else self.inter_node_bandwidth

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
    cp_comm_s: float
    """Context-parallel transfers of the busiest pipeline rank left exposed by its attention's
    compute (inside pipeline_s)."""
    ep_comm_s: float
    """Expert-parallel all-to-alls of the busiest pipeline rank (inside pipeline_s)."""
    p2p_s: float
    dp_comm_s: float
    optimizer_s: float
    latency_s: float
    """Every collective and message of the critical rank at the link's latency."""
    cpu_bound: bool
    """CPU only: the shared cores, not the critical path, set the step time."""


@dataclass(frozen=True)
class _Partition:
    """What the model's cut into stages gives every layout that shares it (the planner predicts
    thousands of layouts, which differ in far fewer cuts)."""

    costs: list
    """`stage_costs`: FLOPs per token of each virtual stage."""
    ranges: list[range]
    rank_stages: list[list[int]]
    rerun: list[int]
    """`_recomputed_layers`."""
    parameters: int
    """The most parameters a pipeline rank holds (one tp rank's)."""


_PARTITIONS: dict[tuple, _Partition] = {}


def _partition(cfg: Config) -> _Partition:
    """`cfg`'s `_Partition`, computed once per model and what cuts it: tp (the parameters of a
    rank), the pipeline's stages and their order (pp, vpp, a V or not), the embedding's and
    head's weights in layers and recompute."""
    p, t = cfg.parallel, cfg.train
    key = (repr(cfg.model), p.tp, p.pp, p.vpp, v_shaped(p.schedule), p.embedding_layer_weight)
    key += (p.head_layer_weight, t.recompute, t.recompute_layers)
    found = _PARTITIONS.get(key)
    if found is None:
        if len(_PARTITIONS) > 4096:
            _PARTITIONS.clear()
        params = max(stage_parameters(cfg, r) for r in range(p.pp))
        found = _Partition(
            stage_costs(cfg), stage_ranges(cfg), rank_stages(cfg), _recomputed_layers(cfg), params
        )
        _PARTITIONS[key] = found
    return found


def per_rank(cfg: Config, per_stage: list[float]) -> list[float]:
    """Sums of a per-virtual-stage quantity over each pipeline rank's chunks."""
    return _per_rank(_partition(cfg), per_stage)


def _per_rank(partition: _Partition, per_stage: list[float]) -> list[float]:
    return [sum(per_stage[s] for s in stages) for stages in partition.rank_stages]


def predict(cfg: Config, machine: Machine) -> Prediction:
    """Seconds per step of `cfg`'s layout on `machine` (see the module docstring)."""
    p, t = cfg.parallel, cfg.train
    dp, m = cfg.layout_for_world(machine.world_size)
    dims = p.dims(machine.world_size)
    element = ELEMENT_BYTES[resolve_precision(t.precision, machine.device)]
    seq = cfg.model.seq_len // p.cp  # this rank's tokens of a window
    act = t.micro_batch_size * seq * cfg.model.hidden * element  # one mb's x on this rank
    partition = _partition(cfg)

    def per_rank(per_stage: list[float]) -> list[float]:
        return _per_rank(partition, per_stage)

    times = _stage_times(cfg, machine, dims, act, element)
    forward, backward = times.forward, times.backward
    makespan, bubble = pipeline_makespan(cfg, m, forward, backward)
    tp_per_rank = [m * s for s in per_rank(times.tp_s)]
    cp_per_rank = [m * s for s in per_rank(times.cp_s)]
    ep_per_rank = [m * s for s in per_rank(times.ep_s)]
    calls = max(m * c for c in per_rank(times.calls))

    # pp: an activation forward and a gradient back per boundary, exposed along fill and drain
    message = act / (p.tp if p.sp else 1) / machine.bandwidth(dims.span("pp"))
    boundaries = p.pp * p.vpp - 1
    p2p = 2 * boundaries * message
    calls += 2 * (boundaries + m) if p.pp > 1 else 0

    params = partition.parameters
    replicas = dp * p.cp  # gradients reduced, ZeRO sharded over dp x cp
    shards = dense_shards(p, replicas)  # HSDP: within cp x dp_shard
    copies = replicas // shards
    # the dp x cp group (cp varies faster than dp), and HSDP's shard group within it
    dp_bw = machine.bandwidth(dims.span("dp"))
    shard_bw = machine.bandwidth(dims.hybrid_dims.span("dp_shard")) if copies > 1 else dp_bw
    split = machine.split_collective_cost
    grads = (shards - 1) / shards * params * 4 / shard_bw  # fp32 main grads, reduce-scattered
    # HSDP: each owned shard all-reduced over its copies once a step, after the backward
    over_copies = 2 * (copies - 1) / copies * params / shards * 4 / dp_bw
    # the parameters' all-gathers: once a step under the next step's first forward (ZeRO-1/2,
    # and ZeRO-3 keeping them for the step), or (ZeRO-3) for every micro-batch's forward and
    # again for its backward, each unit's under the compute of the one before
    regathers = p.zero == 3 and p.reshard_after_forward
    gathers = 2 * m if regathers else int(p.zero > 0)
    gather = gathers * split * (shards - 1) / shards * params * element / shard_bw
    # reduce-scattered under the last micro-batch's backward (ZeRO-2/3: under each one's), an
    # all-reduce without ZeRO
    rounds = m if p.zero >= 2 else 1
    reduce = rounds * grads * (split if p.zero else 2)
    window = rounds * max(per_rank(backward))
    gather_window = min(per_rank(forward))
    if regathers:
        gather_window = m * (gather_window + min(per_rank(backward)))
    dp_s = max(0.0, reduce - window) + max(0.0, gather - gather_window) + over_copies
    buckets = math.ceil(params * 4 / (p.bucket_mb * 2**20))
    calls += buckets * (rounds + gathers + (copies > 1)) if replicas > 1 else 0
    optimizer = params / (shards if p.zero else 1) * OPTIMIZER_BYTES_PER_PARAM
    optimizer /= machine.memory_bandwidth

    step, cpu_bound = makespan + p2p + dp_s + optimizer, False
    if machine.device == "cpu":  # the ranks' work over the shared cores, if that is longer
        compute = m * (sum(forward) + sum(backward))  # the pp ranks together
        p2p_work = 4 * m * boundaries * message  # both ends copy every message
        p2p_work += 2 * m * sum(times.cp_moved_s)  # the ring's, whole, by both ends
        data_parallel = reduce + gather + optimizer + over_copies
        work = p.tp * p.cp * dp * (compute + p2p_work + p.pp * data_parallel)
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
        cp_comm_s=max(cp_per_rank),
        ep_comm_s=max(ep_per_rank),
        p2p_s=p2p,
        dp_comm_s=dp_s,
        optimizer_s=optimizer,
        latency_s=calls * machine.latency_s,
        cpu_bound=cpu_bound,
    )


@dataclass(frozen=True)
class _StageTimes:
    """Per virtual stage, for one micro-batch."""

    forward: list[float]
    """Seconds of its forward: FLOPs, tp transfers, exposed cp transfers, per-layer overhead."""
    backward: list[float]
    tp_s: list[float]
    """The tp transfers among them."""
    cp_s: list[float]
    """The cp transfers among them (exposed)."""
    cp_moved_s: list[float]
    """Seconds the cp transfers take in all, overlapped or not."""
    ep_s: list[float]
    """The expert-parallel all-to-alls among them."""
    calls: list[int]
    """tp collectives and cp messages."""


def _stage_times(
    cfg: Config, machine: Machine, dims: ParallelDims, act: float, element: int
) -> _StageTimes:
    """Per virtual stage and micro-batch: forward and backward seconds (FLOPs, tp transfers,
    exposed cp transfers, per-layer overhead), the tp and cp seconds among them, and the tp
    collectives and cp messages called."""
    p = cfg.parallel
    tokens = cfg.train.micro_batch_size * cfg.model.seq_len // p.cp  # on this rank
    # per layer pass: two all-reduces, or two all-gathers and two reduce-scatters under sp
    per_pass = 0 if p.tp == 1 else 4 if p.sp else 2
    # all-reduces or sp's all-gathers and reduce-scatters: the same bytes either way
    transfer = 4 * (p.tp - 1) / p.tp * act / machine.bandwidth(dims.span("tp"))
    transfer *= machine.split_collective_cost if p.sp else 1.0
    # sp's backward gathers each column-parallel input again (the forward kept its shard): 3/2
    # of the forward's bytes, in as many calls (each row-parallel backward gathers its output
    # gradient and its partner's input at once: tensor_parallel/linear.py)
    backward_transfer = transfer * (1.5 if p.sp else 1.0)
    ring = cp_transfers(cfg, machine, dims, element)
    a2a = ep_transfer(cfg, machine, dims, element)
    times = _StageTimes([], [], [], [], [], [], [])
    partition = _partition(cfg)
    for cost, layers, rerun in zip(partition.costs, partition.ranges, partition.rerun):
        n = len(layers)
        tp_f, tp_b = n * transfer, n * backward_transfer + rerun * transfer
        cp_f, cp_b = n * ring.forward_exposed, n * ring.backward_exposed
        cp_b += rerun * ring.forward_exposed  # recompute runs the forward's ring again
        ep_f, ep_b = 2 * n * a2a, 2 * (n + rerun) * a2a  # dispatch and combine, each way
        fixed = n * machine.layer_overhead_s / 3  # a third forward, two backward
        compute_f, compute_b = (c * tokens / p.tp / machine.rank_flops for c in cost[:2])
        times.forward.append(compute_f + tp_f + cp_f + ep_f + fixed)
        times.backward.append(compute_b + tp_b + cp_b + ep_b + 2 * fixed)
        times.ep_s.append(ep_f + ep_b)
        times.tp_s.append(tp_f + tp_b)
        times.cp_s.append(cp_f + cp_b)
        times.cp_moved_s.append((n + rerun) * ring.forward_moved + n * ring.backward_moved)
        times.calls.append(
            (2 * n + rerun) * per_pass
            + (4 * n + 2 * rerun) * (p.ep > 1)
            + (n + rerun) * ring.forward_messages
            + n * ring.backward_messages
        )
    return times


def ep_transfer(cfg: Config, machine: Machine, dims: ParallelDims, element: int) -> float:
    """Seconds of one all-to-all of a layer's routed rows for one micro-batch (0 at ep 1):
    this rank's tokens times top-k rows of the model width, all but 1/ep of them leaving the
    rank (balanced routing), over the ep group's link."""
    p, m = cfg.parallel, cfg.model
    if p.ep == 1:
        return 0.0
    rows = cfg.train.micro_batch_size * m.seq_len // p.cp * m.moe_top_k
    leaving = (p.ep - 1) / p.ep * rows * m.hidden * element
    return leaving / machine.bandwidth(dims.expert_dims.span("ep"))


@dataclass(frozen=True)
class CpTransfers:
    """One layer's context-parallel traffic for one micro-batch on one rank (0 at cp 1)."""

    forward_exposed: float
    """Seconds of the forward's transfers not hidden by its attention's compute."""
    backward_exposed: float
    forward_moved: float
    """Seconds the forward's transfers take in all."""
    backward_moved: float
    forward_messages: int
    """p2p batches or collectives: each costs the link's latency."""
    backward_messages: int


def cp_transfers(cfg: Config, machine: Machine, dims: ParallelDims, element: int) -> CpTransfers:
    """A layer's cp transfers (see the module docstring): K/V blocks of this rank's kv heads
    over the cp group's link, beside the attention FLOPs of each ring step."""
    p, m = cfg.parallel, cfg.model
    cp = p.cp
    if cp == 1:
        return CpTransfers(0.0, 0.0, 0.0, 0.0, 0, 0)
    tokens = cfg.train.micro_batch_size * m.seq_len // cp
    kv_heads = m.n_kv_heads // p.tp if m.n_kv_heads >= p.tp else 1
    kv = 2 * tokens * kv_heads * m.head_dim * element  # the stacked K and V of this rank
    dkv = kv // element * 4  # their gradients, accumulated in fp32
    bandwidth = machine.bandwidth(dims.span("cp"))
    if p.cp_comm == "allgather":  # one collective each way, nothing to overlap with
        split = machine.split_collective_cost
        gather = split * (cp - 1) * kv / bandwidth
        scatter = split * (cp - 1) * dkv / bandwidth
        return CpTransfers(gather, gather + scatter, gather, gather + scatter, 1, 2)
    # the layer's causal attention scores and weighted sum (fwd 1/3, bwd 2/3 of
    # `stage_costs`' per token), this rank's heads, one ring step's share
    attention = mean_attention_flops(m) * tokens / p.tp / machine.rank_flops / cp
    step_f, step_b = attention / 3, 2 * attention / 3
    kv_s, dkv_s = kv / bandwidth, dkv / bandwidth
    forward = (cp - 1) * max(0.0, kv_s - step_f)  # the last step sends nothing
    # backward step t: K/V on (t < cp - 1) beside the dK/dV of step t - 1 (t >= 1); then the
    # last dK/dV goes home with nothing left to hide it
    backward = max(0.0, kv_s - step_b) + max(0.0, dkv_s - step_b)
    backward += (cp - 2) * max(0.0, kv_s + dkv_s - step_b) + dkv_s
    moved_f, moved_b = (cp - 1) * kv_s, (cp - 1) * kv_s + cp * dkv_s
    return CpTransfers(forward, backward, moved_f, moved_b, cp - 1, 2 * cp - 1)


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
    partition = _partition(cfg)
    rank_cost = [
        f + b
        for f, b in zip(_per_rank(partition, forward), _per_rank(partition, backward), strict=True)
    ]
    flops = partition.costs
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
