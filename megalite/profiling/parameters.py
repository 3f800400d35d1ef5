"""A model chunk's parameters and megalite's gradient-buffer layout, in closed form: the names,
sizes and order `models/` registers them in (so the estimate needs no model build), and the
buckets `data_parallel.grad_buffer` cuts them into (padding and ZeRO ownership included).
`tests/unit/test_estimate.py` checks both against a model built on the meta device."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megalite.config import Config
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
        launched and every earlier one is added in and released."""
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
            while len(in_flight) > 1:
                del alive[in_flight.pop(0)]
        return peak


def _cut(params: list[Param], bucket_numel: int) -> list[list[Param]]:
    """The parameters of each bucket as `GradBuffer` cuts them: in backward (reverse) order, a
    bucket closed once it reaches `bucket_numel` or around an own-bucket parameter."""
    buckets: list[list[Param]] = [[]]
    for param in reversed(params):
        if param.own_bucket and buckets[-1]:
            buckets.append([])
        buckets[-1].append(param)
        if param.own_bucket or sum(p.numel for p in buckets[-1]) >= bucket_numel:
            buckets.append([])
    return [bucket for bucket in buckets if bucket]


def buckets_of(params: list[Param], bucket_numel: int, dp: int) -> list[int]:
    """Bucket sizes as `GradBuffer` cuts them, each padded to a multiple of dp."""
    return [-(-sum(p.numel for p in bucket) // dp) * dp for bucket in _cut(params, bucket_numel)]


def gradient_arrival(params: list[Param], bucket_numel: int) -> tuple[int, ...]:
    """The bucket of each gradient in the order backward delivers them: reverse registration
    order, except those that arrive last (`Param.arrives_last`)."""
    bucket_of = {p.name: i for i, bucket in enumerate(_cut(params, bucket_numel)) for p in bucket}
    backward = list(reversed(params))
    order = [p for p in backward if not p.arrives_last] + [p for p in backward if p.arrives_last]
    return tuple(bucket_of[p.name] for p in order)


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
            replicas = dp // p.ep if expert else dp
            buckets = buckets_of(mine, bucket_numel, replicas)
            arrival = gradient_arrival(mine, bucket_numel)
            layouts.append(BufferLayout(buckets, replicas, module_buffers, arrival))
            module_buffers = []  # counted once per chunk
    return layouts
