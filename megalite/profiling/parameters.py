"""A model chunk's parameters and megalite's gradient-buffer layout, in closed form: the names,
sizes and order `models/` registers them in (so the estimate needs no model build), and the
buckets `data_parallel.grad_buffer` cuts them into (padding and ZeRO ownership included).
`tests/unit/test_estimate.py` checks both against a model built on the meta device."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megalite.config import Config, ParallelConfig
from megalite.models.formulas import Param, formulas_of
from megalite.models.partition import chunk_layers
from megalite.profiling.activations import head_rows


def chunk_parameters(
    cfg: Config, layers: range, has_embedding: bool, has_head: bool
) -> list[Param]:
    """One tp rank's parameters of a chunk, in `chunk.parameters()` order."""
    formulas, rows = formulas_of(cfg.model.arch), head_rows(cfg)
    params = formulas.embedding_parameters(cfg, rows, has_head) if has_embedding else []
    for i in layers:
        params += formulas.layer_parameters(cfg, i)
    if has_head:
        params += formulas.head_parameters(cfg, rows, has_embedding)
    return params


def stage_parameters(cfg: Config, pp_rank: int) -> int:
    """Parameters one tp rank of pipeline rank `pp_rank` holds (all its chunks)."""
    last = cfg.parallel.pp * cfg.parallel.vpp - 1
    return sum(
        param.numel
        for stage, layers in chunk_layers(cfg, pp_rank)
        for param in chunk_parameters(cfg, layers, stage == 0, stage == last)
    )


@dataclass(frozen=True)
class BufferLayout:
    """One chunk's flat parameter / gradient buffer."""

    buckets: list[int]
    """Elements of each bucket, padded to a multiple of dp."""
    dp: int
    module_buffers: list[int]
    """Elements of the chunk's non-parameter buffers (rotary cos / sin tables per layer)."""
    arrival: tuple[int, ...] = ()
    """The bucket of each parameter's gradient, in the order backward delivers them."""
    units: tuple[str, ...] = ()
    """ZeRO-3: each bucket's unit, by which the reductions in flight are folded (`GradBuffer.
    _reduce_staged`); empty: each bucket by itself."""

    @property
    def padded(self) -> int:
        return sum(self.buckets)

    def owned_pieces(self, sharded: bool) -> list[int]:
        """Elements of each piece whose optimizer state this rank holds (1/dp of every bucket
        under ZeRO-1, else whole buckets)."""
        return [n // self.dp for n in self.buckets] if sharded else list(self.buckets)

    def staging_pieces(self) -> list[int]:
        """ZeRO-2: elements of the fp32 staging alive at once at this buffer's peak, replaying
        `GradBuffer`'s policy over the order the gradients arrive: a bucket's staging is taken
        at its first gradient; once complete it gets its received piece, its reduce-scatter is
        launched and every earlier one (ZeRO-3: of an earlier unit) is added in and released."""

        def key(bucket: int) -> object:
            return self.units[bucket] if self.units else bucket

        pending = Counter(self.arrival)
        alive: dict[int, list[int]] = {}
        in_flight: list[int] = []
        peak: list[int] = []
        for bucket in self.arrival:
            if bucket not in alive:
                alive[bucket] = [self.buckets[bucket]]
            pending[bucket] -= 1
            if pending[bucket] == 0:
                alive[bucket].append(self.buckets[bucket] // self.dp)
                in_flight.append(bucket)
            held = [n for tensors in alive.values() for n in tensors]
            peak = max(peak, held, key=sum)
            while in_flight and key(in_flight[0]) != key(in_flight[-1]):
                del alive[in_flight.pop(0)]
        return peak


def zero3_unit(name: str) -> str:
    """The ZeRO-3 unit (`data_parallel.zero3`) a shipped chunk's parameter belongs to, by its
    name: its block (`layers.<i>`), its top-level module, or the chunk itself ("") for those it
    holds directly (GPT's `wpe`)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(parts[:2])
    return parts[0] if len(parts) > 1 else ""


def _cut(params: list[Param], bucket_numel: int, by_unit: bool = False) -> list[list[Param]]:
    """The parameters of each bucket as `GradBuffer` cuts them: in backward (reverse) order, a
    bucket closed once it reaches `bucket_numel`, around an own-bucket parameter and (`by_unit`,
    ZeRO-3) where the unit changes."""
    buckets: list[list[Param]] = [[]]
    for param in reversed(params):
        new_unit = (
            by_unit and buckets[-1] and zero3_unit(param.name) != zero3_unit(buckets[-1][0].name)
        )
        if (param.own_bucket or new_unit) and buckets[-1]:
            buckets.append([])
        buckets[-1].append(param)
        if param.own_bucket or sum(p.numel for p in buckets[-1]) >= bucket_numel:
            buckets.append([])
    return [bucket for bucket in buckets if bucket]


def buckets_of(params: list[Param], bucket_numel: int, dp: int, by_unit: bool = False) -> list[int]:
    """Bucket sizes as `GradBuffer` cuts them, each padded to a multiple of dp."""
    buckets = _cut(params, bucket_numel, by_unit)
    return [-(-sum(p.numel for p in bucket) // dp) * dp for bucket in buckets]


def gradient_arrival(
    params: list[Param], bucket_numel: int, by_unit: bool = False
) -> tuple[int, ...]:
    """The bucket of each gradient in the order backward delivers them: reverse registration
    order, except those that arrive last (`Param.arrives_last`)."""
    buckets = _cut(params, bucket_numel, by_unit)
    bucket_of = {p.name: i for i, bucket in enumerate(buckets) for p in bucket}
    backward = list(reversed(params))
    order = [p for p in backward if not p.arrives_last] + [p for p in backward if p.arrives_last]
    return tuple(bucket_of[p.name] for p in order)


def dense_shards(parallel: ParallelConfig, replicas: int) -> int:
    """The ranks the dense weights' buffers are padded to and ZeRO-sharded over
    (`GradBuffer.shard_size`), of their `replicas` (dp x cp): all of them, but under HSDP the
    cp x dp_shard of each copy."""
    return replicas // parallel.dp_replicate


def layout_buffers(cfg: Config, pp_rank: int, dp: int) -> list[BufferLayout]:
    """The gradient buffers of `pp_rank`'s chunks (one each: a chunk has one dtype; and one of
    its MoE experts, replicated over dp / ep, where it has them). `dp`: the replicas of the
    dense weights (dp x cp)."""
    p = cfg.parallel
    last = p.pp * p.vpp - 1
    bucket_numel = max(1, int(p.bucket_mb * 2**20 / 4))
    layer_buffers = formulas_of(cfg.model.arch).layer_buffers(cfg.model)
    layouts = []
    for stage, layers in chunk_layers(cfg, pp_rank):
        params = chunk_parameters(cfg, layers, stage == 0, stage == last)
        module_buffers = layer_buffers * len(layers)
        for expert in (False, True):
            mine = [param for param in params if param.expert == expert]
            if not mine:
                continue
            replicas = dp // p.ep if expert else dense_shards(p, dp)
            buckets = buckets_of(mine, bucket_numel, replicas, p.zero == 3)
            arrival = gradient_arrival(mine, bucket_numel, p.zero == 3)
            by_unit = _cut(mine, bucket_numel, True) if p.zero == 3 else []
            units = tuple(zero3_unit(bucket[0].name) for bucket in by_unit)
            layouts.append(BufferLayout(buckets, replicas, module_buffers, arrival, units))
            module_buffers = []  # counted once per chunk
    return layouts


def zero3_gathered(cfg: Config, pp_rank: int, dp: int) -> int:
    """Elements of full parameters a ZeRO-3 rank holds gathered at once at most, over its chunks
    (one computes at a time), replaying `data_parallel.zero3` over a forward and a backward:
    the chunk's own unit throughout; the unit computing and the one prefetched beside it; a
    tied embedding read by the head (no `lm_head` parameter of its own) from its forward to the
    head's and from the head's backward on. A split backward, which keeps a B's units until its
    W, is not replayed. `dp`: the replicas (dp x cp); buffers with one replica stay whole
    (`parameters`). Kept for the step (`parallel.reshard_after_forward=false`): every unit of
    every chunk, all gathered by the end of the first micro-batch's forwards."""
    p = cfg.parallel
    last = p.pp * p.vpp - 1
    bucket_numel = max(1, int(p.bucket_mb * 2**20 / 4))
    peak = kept = 0
    for stage, layers in chunk_layers(cfg, pp_rank):
        params = chunk_parameters(cfg, layers, stage == 0, stage == last)
        sizes: Counter[str] = Counter()
        for expert in (False, True):
            mine = [param for param in params if param.expert == expert]
            replicas = dp // p.ep if expert else dense_shards(p, dp)
            if replicas > 1:
                for bucket in _cut(mine, bucket_numel, by_unit=True):
                    padded = -(-sum(param.numel for param in bucket) // replicas) * replicas
                    sizes[zero3_unit(bucket[0].name)] += padded
        peak = max(peak, _unit_peak(sizes, params, stage == last))
        kept += sum(sizes.values())
    return peak if p.reshard_after_forward else kept


def _unit_peak(sizes: Counter[str], params: list[Param], has_head: bool) -> int:
    """`zero3_gathered` for one chunk: its units in forward order (registration order, the
    chunk's own apart), the head reading the embedding's unit again where it is tied."""
    units = [u for u in dict.fromkeys(zero3_unit(param.name) for param in params) if u]
    tied = has_head and bool(units) and not any(u.startswith("lm_head") for u in units)
    held = [units[0]] if tied else []
    order = units + held

    def gathered(names: list[str]) -> int:
        return sizes[""] + sum(sizes[name] for name in set(names + held))

    forward = [gathered(order[k : k + 2]) for k in range(len(order))]
    backward = [gathered(order[max(k - 1, 0) : k + 1]) for k in range(len(order))]
    return max(forward + backward, default=sizes[""])
