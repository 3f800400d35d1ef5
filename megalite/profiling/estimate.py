"""The memory of every pipeline rank of a layout, in closed form: no model is built, so any size
estimates in milliseconds.

Per rank (first, middle and last pipeline stage, each with the vpp chunks it holds) the estimate
is a table of parts, each on a device ("gpu", or "host" for the optimizer's state under
optim.offload=cpu):

- parameters, module buffers (rotary tables), fp32 gradients and optimizer state, counted as
  megalite lays them out: one flat buffer per chunk, cut into buckets padded to a multiple of
  the replicas, dp x cp (the ranks that hold the same weights, over which gradients are
  reduced and ZeRO shards: `ParallelState.group("dp", "cp")`; "dp" in the rest of this list),
  with ZeRO-1 owning 1/dp of each bucket (fp32 master where params are 16-bit, Adam m and v, the
  reduced-gradient shard, the update's scratch); ZeRO-2 keeps only the shard, and its
  backward stages two consecutive buckets at most (`GradBuffer`: the bucket just completed and
  the one whose reduce-scatter is in flight, each with its received piece);
- activations saved for backward (`profiling.activations`) summed over the (micro-batch,
  chunk) pairs the rank's schedule holds at its peak, found by walking its action list (the
  order `pipeline.simulate` runs); the LM head's kept weight gradient is its own part (one per
  micro-batch in flight on the last stage), and so are the transient working sets at that peak:
  a chunk of logits in the head's forward, the head's gradients scaled in its backward, or the
  layer (full) or segment (segments, sqrt(L) checkpointing) that recompute runs again in
  backward. Under a split backward (zb-h1, zb-v) a pair's activations go at its B, but its
  linears' inputs and output gradients stay until its W (`deferred weight-grad inputs`), and so
  do the gradients B computed for the other parameters, in their `.grad` (`gradients awaiting
  W`: the embedding and head weigh most; in 16 bits each pair's own until its W; in fp32 one per
  chunk, and without ZeRO-2 only until the chunk's first W, after which `.grad` is the fp32 main
  grad itself). Attention over a chunk layout (context
  parallelism, document masks) adds a transient of its own, in forward and in backward (a
  recomputed layer's beside its rerun activations): the K/V blocks it computes against and
  passes on and its fp32 accumulators (`ring attention buffers`, `all-gathered K/V`, `block
  attention buffers` at cp 1: `activations.attention_working_sets`).

Context parallelism (cp ranks) leaves each rank seq_len / cp tokens of every window, so every
activation term is that of seq_len / cp tokens (`models.formulas.Shapes`); parameters and
gradients are replicated over cp as over dp, the optimizer's state sharded over dp x cp.

Beside the bytes, what `nvidia-smi` would show: each tensor rounded the way PyTorch's CUDA
caching allocator rounds it (512-byte blocks; requests up to 1 MiB from 2 MiB segments, up to
10 MiB from 20 MiB segments, larger ones their own segment rounded to 2 MiB), plus the CUDA
context.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from megalite.config import Config, OptimConfig
from megalite.models.partition import chunk_layers
from megalite.optimizer.adamw import SCRATCH_BYTES_PER_ELEMENT, scratch_numel
from megalite.pipeline.schedule import Op, compute_order
from megalite.profiling import activations as act
from megalite.profiling.parameters import (
    Param,
    chunk_parameters,
    layout_buffers,
    stage_parameters,
    zero3_gathered,
)

CUDA_CONTEXT_BYTES = 768 * 2**20
"""What nvidia-smi shows for a training process beyond the caching allocator's reservation:
the CUDA context (driver state, loaded kernels of torch, cuBLAS and Triton) and library
workspaces. Measured on an H100 80GB with torch 2.13 / CUDA 12.8 during `megalite profile` of
gpt2-124m: 8,579 MiB in nvidia-smi against 7,828 MiB reserved, 751 MiB. It depends on the
device, driver and libraries: override with `--cuda-context` / `estimate_layout(...,
cuda_context=...)`."""
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Part:
    """One line of a stage's table."""

    name: str
    bytes: int
    tensors: tuple[int, ...] = ()
    """Sizes of the tensors behind it, for the allocator's rounding (empty: treated as one)."""
    device: str = "gpu"
    """Where it lives: "gpu", or "host" for state offloaded to CPU memory."""


@dataclass(frozen=True)
class StageEstimate:
    pp_rank: int
    chunks: list[tuple[int, range]]
    """(virtual stage, layers) of each local chunk."""
    parameters: int
    """Model parameters held by one tp rank (unpadded)."""
    in_flight: int
    """(micro-batch, chunk) activations held at this rank's peak."""
    parts: list[Part] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes on the GPU at this rank's peak."""
        return sum(p.bytes for p in self.parts if p.device == "gpu")

    def part(self, name: str) -> int:
        return sum(p.bytes for p in self.parts if p.name == name)


@dataclass(frozen=True)
class LayoutEstimate:
    cfg: Config
    world_size: int
    dp: int
    microbatches: int
    precision: str
    device: str
    stages: list[StageEstimate]
    cuda_context: int

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, dp x cp: gradients are reduced and ZeRO shards over
        them."""
        return self.dp * self.cfg.parallel.cp

    @property
    def peak_bytes(self) -> int:
        """The fullest rank's bytes (what must fit in one GPU's memory, context aside)."""
        return max(stage.total_bytes for stage in self.stages)

    def gpu_bytes(self, stage: StageEstimate) -> int:
        """What nvidia-smi would show for the rank: the caching allocator's segments for every
        part, plus the CUDA context."""
        sizes = [s for p in stage.parts if p.device == "gpu" for s in (p.tensors or (p.bytes,))]
        return reserved_bytes(sizes) + self.cuda_context


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def reserved_bytes(sizes: Iterable[int]) -> int:
    """Bytes the CUDA caching allocator reserves to hold tensors of these sizes at once: each
    rounded up to 512 bytes; those up to 1 MiB packed into 2 MiB segments, those up to 10 MiB
    into 20 MiB segments (first fit), larger ones in a segment of their own rounded to 2 MiB."""
    mib = 2**20
    small, medium, large = 0, [], 0
    for size in sizes:
        block = _round_up(max(size, 1), 512)
        if block <= mib:
            small += block
        elif block < 10 * mib:
            medium.append(block)
        else:
            large += _round_up(block, 2 * mib)
    segments: list[int] = []  # free bytes of each 20 MiB segment
    for block in sorted(medium, reverse=True):
        fit = next((i for i, free in enumerate(segments) if free >= block), None)
        if fit is None:
            segments.append(20 * mib)
            fit = len(segments) - 1
        segments[fit] -= block
    return _round_up(small, 2 * mib) + 20 * mib * len(segments) + large


def resolve_precision(precision: str, device: str) -> str:
    """auto: bf16 on CUDA, fp32 on CPU (as training resolves it)."""
    if precision == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return precision


def _static_parts(cfg: Config, pp_rank: int, dp: int, element: int, device: str) -> list[Part]:
    """Parameters, buffers, gradients and optimizer state of one rank's chunks; `dp`: the
    replicas (dp x cp)."""
    buffers = layout_buffers(cfg, pp_rank, dp)
    zero = cfg.parallel.zero
    sharded = [zero >= 1 and b.dp > 1 for b in buffers]  # a buffer's replicas: dp, or dp / ep
    # ZeRO-3: between steps only the owned pieces of the parameters (one tensor per buffer)
    resident = [
        sum(b.owned_pieces(True)) if s and zero == 3 else b.padded for b, s in zip(buffers, sharded)
    ]
    owned = [piece for b, s in zip(buffers, sharded) for piece in b.owned_pieces(s)]
    # ZeRO-3 with the optimizer offloaded: the owned pieces on the host (`offload_params`)
    offloaded = [zero == 3 and s and cfg.optim.offload == "cpu" for s in sharded]
    owned_on_host = [
        off for b, s, off in zip(buffers, sharded, offloaded) for _ in b.owned_pieces(s)
    ]
    # ZeRO-2 and 3: no full-size gradient buffer, only the owned shard
    grads = [4 * b.padded for b, s in zip(buffers, sharded) if not (s and zero >= 2)]
    grads += [4 * n for b, s in zip(buffers, sharded) if s for n in b.owned_pieces(True)]
    # ZeRO-2's buckets are staged during each backward only, one chunk's at a time
    staged = [b.staging_pieces() for b, s in zip(buffers, sharded) if s and zero >= 2]
    staging = max(staged, key=sum, default=[])
    rotary = [n * element for b in buffers for n in b.module_buffers]
    on_device = [n * element for n, off in zip(resident, offloaded) if not off]
    on_host = [n * element for n, off in zip(resident, offloaded) if off]
    parts = [
        Part("parameters", sum(on_device), tuple(on_device)),
        Part("buffers", sum(rotary), tuple(rotary)),
        Part("gradients", sum(grads), tuple(grads)),
        Part("gradient staging", 4 * sum(staging), tuple(4 * n for n in staging)),
        _optimizer_part(cfg.optim, owned, element, device, owned_on_host),
    ]
    if zero == 3:  # the units' full parameters, gathered around their forward and backward
        parts.insert(1, Part("parameter gathers", zero3_gathered(cfg, pp_rank, dp) * element))
    if any(offloaded):
        parts.insert(1, Part("offloaded parameters", sum(on_host), tuple(on_host), "host"))
    return parts


def _optimizer_part(
    o: OptimConfig, owned: list[int], element: int, device: str, on_host: list[bool]
) -> Part:
    """The optimizer's tensors for the owned pieces (`optimizer.distributed`, `adamw`, `offload`):
    fp32 master weights (unless the params are fp32 and stay on the device) and Adam's m and v
    in optim.state_dtype; with optim.offload=cpu all on the host, plus each piece's fp32
    gradient staging and, for 16-bit params, its upload staging; a bf16-state update's upcast
    scratch (sized for the device that runs the update). `on_host`: per piece, whether its
    parameters live on the host too (ZeRO-3's, offloaded), so that fp32 ones are their own
    masters and nothing is staged for the way up."""
    offload = o.offload == "cpu"
    moment = ELEMENT_BYTES[o.state_dtype]
    tensors = []
    for n, here in zip(owned, on_host):
        per_owned = [4] * ((offload and not here) or element != 4) + [moment, moment]
        if offload:
            per_owned += [4] + [element] * (element != 4 and not here)
        tensors += [n * k for k in per_owned]
    largest = max(owned, default=0)
    scratch = scratch_numel(largest, o.state_dtype, "cpu" if offload else device)
    tensors += [scratch * SCRATCH_BYTES_PER_ELEMENT] if scratch else []
    return Part("optimizer", sum(tensors), tuple(tensors), "host" if offload else "gpu")


Transient = tuple[tuple[str, int], ...]
"""What a compute step allocates beyond what is kept, as named pieces (a line each in the
table): the largest such set at the rank's peak is added to it."""


def _bytes(transient: Transient) -> int:
    return sum(n for _, n in transient)


def _largest(*options: Transient) -> Transient:
    """The option that allocates most, its pieces of 0 bytes left out."""
    return tuple((name, n) for name, n in max(options, key=_bytes) if n)


@dataclass
class _Chunk:
    """What one micro-batch of one local chunk keeps, and the transients it runs with."""

    kept: list[int]
    head_grad: int
    forward_working: Transient
    """The largest transient of the chunk's forward."""
    backward_working: Transient
    """The largest transient of the chunk's backward."""
    deferred: list[int]
    """Under a split backward: what its linears hold from B until W."""
    deferred_in_backward: int
    """Under a split backward: what the layers already done hold while recompute reruns the
    last region (the backward's working set) in B."""
    awaiting: int
    """Under a split backward: the gradients B leaves in `.grad` until W (every parameter but
    the linears', whose gradients W computes)."""


RECOMPUTE_WORKING_SET = "recompute working set"


DEFERRED_PARAMS = ("wqkv.weight", "wqkv.bias", "wo.weight", "fc.weight", "proj.weight")
DEFERRED_PARAMS += ("gate_up.weight", "down.weight")
"""The parameters whose gradient a split backward computes in W, by their names' last two
parts: those of the tensor-parallel linears' autograd functions (a row-parallel linear adds
its bias outside; GPT's fc bias goes to the fused bias-GELU). Experts' weights, though named
alike, are no such linears."""


def gradients_awaiting_w(params: list[Param], element: int) -> int:
    """Bytes of the gradients that wait in `.grad` from B until W."""
    return element * sum(p.numel for p in params if not _deferred(p))


def _deferred(param: Param) -> bool:
    return not param.expert and ".".join(param.name.split(".")[-2:]) in DEFERRED_PARAMS


def _chunk_activations(
    x: act.Shapes, stage: int, layers: range, n_stages: int, params: list[Param]
) -> _Chunk:
    t, h = x.cfg.train, x.cfg.model.hidden
    first, last = stage == 0, stage == n_stages - 1
    n = len(layers)
    layer_input = x.stream_tokens * h * x.element
    body = act.layer_body(x)
    kept = act.embedding_kept(x) if first else []
    working, region = 0, n  # region: the layers recompute reruns last in B
    if t.recompute == "segments":  # sqrt(L) checkpointing: each segment keeps its input
        size = max(1, round(math.sqrt(n)))
        kept += [layer_input] * -(-n // size)
        working, region = size * (sum(body) + layer_input), size
    else:
        recomputed = 0
        if t.recompute == "full":
            recomputed = n if t.recompute_layers is None else min(t.recompute_layers, n)
            working, region = (sum(body), 1) if recomputed else (0, n)
        for i in range(n):
            # A layer's input is held by a pipeline receive (a chunk's first layer off stage
            # 0), by recompute, or else by its first norm when that norm keeps its input.
            held = (i == 0 and not first) or i < recomputed or act.norm_keeps_input(x)
            kept += [layer_input] * held + (body if i >= recomputed else [])
    if last:
        kept += act.head_kept(x)
    # a layer's attention over a chunk layout runs with its K/V blocks and accumulators; in
    # backward a recomputed layer's does too, beside the layer's rerun activations
    attention_forward, attention_backward = act.attention_working_sets(x) if n else (("", 0),) * 2
    return _Chunk(
        kept=kept,
        head_grad=act.head_weight_grad(x) if last else 0,
        forward_working=_largest(
            (("logits chunk", act.logits_working_set(x) if last else 0),),
            (attention_forward,),
        ),
        backward_working=_largest(
            ((RECOMPUTE_WORKING_SET, working), attention_backward) if working else (),
            (("head backward", act.head_backward_working_set(x) if last else 0),),
            (attention_backward,),
        ),
        deferred=act.deferred_weight_inputs(x) * n,
        deferred_in_backward=sum(act.deferred_weight_inputs(x)) * (n - region),
        awaiting=gradients_awaiting_w(params, x.element),
    )


@dataclass
class _Peak:
    """The rank's state at its peak so far: bytes, and per local chunk the pairs holding
    activations (F run, B not), holding deferred inputs (B run, W not) and whether B's
    gradients wait in `.grad`."""

    total: int = -1
    alive: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    awaiting: tuple[bool, ...] = ()
    transient: Transient = ()


def _activation_parts(
    cfg: Config, x: act.Shapes, pp_rank: int, chunks: list[tuple[int, range]], m: int, dp: int
) -> tuple[int, list[Part]]:
    """Walk the rank's schedule: each forward adds its chunk's kept tensors, each backward
    frees them (keeping what W needs under a split backward, until W); the peak counts the
    transient of the compute running at that moment too. `dp`: the replicas (dp x cp)."""
    p = cfg.parallel
    n_stages = p.pp * p.vpp
    params = [chunk_parameters(cfg, layers, s == 0, s == n_stages - 1) for s, layers in chunks]
    per_chunk = [
        _chunk_activations(x, stage, layers, n_stages, chunk_params)
        for (stage, layers), chunk_params in zip(chunks, params)
    ]
    chunk_bytes = [sum(c.kept) + c.head_grad for c in per_chunk]
    actions = compute_order(p.schedule, p.pp, pp_rank, m, p.vpp, p.microbatch_group_size)
    split = any(a.op is Op.WEIGHT for a in actions)
    fresh_grads = x.element != 4 or (p.zero >= 2 and dp > 1)  # else `.grad` becomes main_grad
    per_pair = x.element != 4  # 16-bit: B takes each pair's gradients from `.grad` until its W
    alive, waiting = [0] * len(per_chunk), [0] * len(per_chunk)
    awaiting, took = [False] * len(per_chunk), [False] * len(per_chunk)
    held = 0
    peak = _Peak()

    def under_split(working: Transient, extra: int) -> Transient:
        """A backward's transient under a split backward: the layers done before recompute's
        rerun region hold their deferred inputs meanwhile."""
        return tuple((name, n + extra * (name == RECOMPUTE_WORKING_SET)) for name, n in working)

    forward_working = [(_bytes(c.forward_working), c.forward_working) for c in per_chunk]
    backward_working = [
        under_split(c.backward_working, c.deferred_in_backward if split else 0) for c in per_chunk
    ]
    backward_working = [(_bytes(w), w) for w in backward_working]

    def observe(transient: tuple[int, Transient] = (0, ())) -> None:
        nonlocal peak
        if held + transient[0] > peak.total:
            state = (tuple(alive), tuple(waiting), tuple(awaiting))
            peak = _Peak(held + transient[0], *state, transient[1])

    for action in actions:
        k, c = action.chunk, per_chunk[action.chunk]
        if action.op is Op.FORWARD:
            alive[k] += 1
            held += chunk_bytes[k]
            observe(forward_working[k])
        elif action.op is Op.BACKWARD:
            observe(backward_working[k])
            alive[k] -= 1
            held -= chunk_bytes[k]
            if split:
                waiting[k] += 1
                held += sum(c.deferred)
                if per_pair:
                    held += c.awaiting
                elif not awaiting[k] and (fresh_grads or not took[k]):
                    awaiting[k] = True
                    held += c.awaiting
                observe()
        else:
            waiting[k] -= 1
            held -= sum(c.deferred)
            held -= c.awaiting if awaiting[k] or per_pair else 0
            awaiting[k], took[k] = False, True

    def each(counts: tuple[int, ...], sizes: Callable[[_Chunk], list[int]]) -> tuple[int, ...]:
        return tuple(s for k, n in enumerate(counts) for _ in range(n) for s in sizes(per_chunk[k]))

    kept = each(peak.alive, lambda c: c.kept)
    head = tuple(s for s in each(peak.alive, lambda c: [c.head_grad]) if s)
    deferred = each(peak.waiting, lambda c: c.deferred)
    grads = tuple(c.awaiting for c, on in zip(per_chunk, peak.awaiting) if on)
    if per_pair:
        grads = each(peak.waiting, lambda c: [c.awaiting])
    parts = [Part("activations", sum(kept), kept), Part("head weight grads", sum(head), head)]
    if split:
        parts.append(Part("deferred weight-grad inputs", sum(deferred), deferred))
        parts.append(Part("gradients awaiting W", sum(grads), grads))
    parts += [Part(name, n) for name, n in peak.transient]
    return sum(peak.alive), parts


def estimate_layout(
    cfg: Config, world_size: int, device: str = "cuda", cuda_context: int = CUDA_CONTEXT_BYTES
) -> LayoutEstimate:
    """Bytes per part of every pipeline rank of `cfg` on `world_size` ranks. `device`: "cuda"
    (Triton kernels, bf16 for precision=auto) or "cpu" (what a CPU run keeps: the PyTorch
    reference kernels, fp32 for auto). Raises ConfigError for a layout that cannot run."""
    dp, m = cfg.layout_for_world(world_size)
    replicas = dp * cfg.parallel.cp  # gradients reduced, optimizer sharded over dp x cp
    precision = resolve_precision(cfg.train.precision, device)
    element = ELEMENT_BYTES[precision]
    x = act.Shapes(cfg, element, device)
    stages = []
    for pp_rank in range(cfg.parallel.pp):
        chunks = chunk_layers(cfg, pp_rank)
        in_flight, activation = _activation_parts(cfg, x, pp_rank, chunks, m, replicas)
        static = _static_parts(cfg, pp_rank, replicas, element, device)
        params = stage_parameters(cfg, pp_rank)
        stages.append(StageEstimate(pp_rank, chunks, params, in_flight, static + activation))
    return LayoutEstimate(cfg, world_size, dp, m, precision, device, stages, cuda_context)


def zero_paper_bytes(parameters: float, dp: int, zero: int) -> float:
    """Rajbhandari et al. (2020)'s model-state accounting: 2 + 2 + K bytes per parameter
    (16-bit params and grads, K = 12 of fp32 master, momentum and variance), the K part
    divided by dp under ZeRO-1 (P_os), the gradients' 2 too under ZeRO-2 (P_os+g), and the
    parameters' 2 under ZeRO-3 (P_os+g+p). megalite keeps fp32 gradients (4 bytes, not 2)."""
    k = 12
    params = 2 / (dp if zero >= 3 else 1)
    return parameters * (params + 2 / (dp if zero >= 2 else 1) + k / (dp if zero else 1))
