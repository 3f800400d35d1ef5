"""A model chunk's parameters and megalite's gradient-buffer layout, in closed form: the names,
sizes and order `models/` registers them in (so the estimate needs no model build), and the
buckets `optimizer.grad_buffer` cuts them into (padding and ZeRO ownership included).
`tests/unit/test_estimate.py` checks both against a model built on the meta device."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megalite.config import Config
from megalite.pipeline.partition import chunk_layers
from megalite.profiling.activations import head_rows


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    """On one tp rank."""
    own_bucket: bool = False
    """GPT's embedding shared by the first and last pipeline stage gets a bucket of its own."""


def _layer(cfg: Config, i: int) -> list[Param]:
    m, tp = cfg.model, cfg.parallel.tp
    h, f, hd = m.hidden, m.ffn_hidden // tp, m.head_dim
    q = h // tp
    kv = (m.n_kv_heads // tp if m.n_kv_heads >= tp else m.n_kv_heads) * hd
    pre = f"layers.{i}."
    if m.arch == "gpt":
        shapes = [
            ("attn_norm.weight", h), ("attn_norm.bias", h),
            ("attn.wqkv.weight", (q + 2 * kv) * h), ("attn.wqkv.bias", q + 2 * kv),
            ("attn.wo.weight", h * q), ("attn.wo.bias", h),
            ("mlp_norm.weight", h), ("mlp_norm.bias", h),
            ("mlp.fc.weight", f * h), ("mlp.fc.bias", f),
            ("mlp.proj.weight", h * f), ("mlp.proj.bias", h),
        ]  # fmt: skip
    else:
        shapes = [
            ("attn_norm.weight", h),
            ("attn.wqkv.weight", (q + 2 * kv) * h),
            ("attn.wo.weight", h * q),
            ("mlp_norm.weight", h),
            ("mlp.gate_up.weight", 2 * f * h), ("mlp.down.weight", h * f),
        ]  # fmt: skip
    return [Param(pre + name, n) for name, n in shapes]


def chunk_parameters(
    cfg: Config, layers: range, has_embedding: bool, has_head: bool
) -> list[Param]:
    """One tp rank's parameters of a chunk, in `chunk.parameters()` order."""
    m = cfg.model
    vocab = head_rows(cfg) * m.hidden
    gpt = m.arch == "gpt"
    params = []
    if has_embedding:
        if gpt:  # wpe is the chunk's own parameter, so it comes before the submodules'
            params.append(Param("wpe", m.max_positions * m.hidden))
        name = "wte.weight" if gpt else "tok_embeddings.weight"
        params.append(Param(name, vocab, own_bucket=gpt and not has_head))
    for i in layers:
        params += _layer(cfg, i)
    if has_head:
        params.append(Param("final_norm.weight", m.hidden))
        if gpt:
            params.append(Param("final_norm.bias", m.hidden))
        if not (gpt and has_embedding):  # GPT's head on the embedding's chunk is the same tensor
            params.append(Param("lm_head.weight", vocab, own_bucket=gpt))
    return params


@dataclass(frozen=True)
class BufferLayout:
    """One chunk's flat parameter / gradient buffer."""

    buckets: list[int]
    """Elements of each bucket, padded to a multiple of dp."""
    dp: int
    module_buffers: list[int]
    """Elements of the chunk's non-parameter buffers (Llama's rotary cos / sin per layer)."""
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
    order, except that GPT's position table (added after the token lookup, and a leaf: autograd
    accumulates it at once) arrives before the token embedding, whose gradient comes last."""
    bucket_of = {p.name: i for i, bucket in enumerate(_cut(params, bucket_numel)) for p in bucket}
    names = [p.name for p in reversed(params)]
    if "wpe" in names:
        names.remove("wte.weight")
        names.append("wte.weight")
    return tuple(bucket_of[name] for name in names)


def layout_buffers(cfg: Config, pp_rank: int, dp: int) -> list[BufferLayout]:
    """The gradient buffers of `pp_rank`'s chunks (one each: a chunk has one dtype)."""
    p, m = cfg.parallel, cfg.model
    last = p.pp * p.vpp - 1
    bucket_numel = max(1, int(p.bucket_mb * 2**20 / 4))
    rotary = [m.max_positions * m.head_dim] * 2 if m.arch == "llama" else []
    layouts = []
    for stage, layers in chunk_layers(cfg, pp_rank):
        params = chunk_parameters(cfg, layers, stage == 0, stage == last)
        buckets = buckets_of(params, bucket_numel, dp)
        arrival = gradient_arrival(params, bucket_numel)
        layouts.append(BufferLayout(buckets, dp, rotary * len(layers), arrival))
    return layouts
