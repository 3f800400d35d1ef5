"""The parallel building blocks every architecture is made of: norms, rotary embeddings,
attention with its heads split over tp ranks, and dropout that knows the sharding. Each
architecture's model (models/<arch>/model.py) shows its own block and forward pass;
`causal_lm.CausalLM` is the pipeline chunk they all are.

Shapes: activations are (batch, seq, hidden); under sequence parallelism (SP) the tensors that
flow between layers are sequence shards (batch, seq/tp, hidden), and attention and the MLP see
the full sequence with their heads / columns split over tp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megalite.kernels import flash_attention, layer_norm, rms_norm, rotary_embedding
from torch import nn

from megalite.config import ModelConfig
from megalite.context_parallel.attention import chunked_attention
from megalite.context_parallel.layout import SequenceLayout
from megalite.float8.gemm import Float8Training
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import (
    ColumnOutput,
    FusedColumnParallelLinear,
    ParamMeta,
    RowParallelLinear,
    TPRandom,
    constant_init,
    make_param,
    normal_init,
    recompute,
)
from megalite.tensor_parallel.deferred import Deferral
from megalite.tensor_parallel.layers import InitFn
from megalite.tensor_parallel.linear import LinearPair


@dataclass
class BuildContext:
    """What every module of one model chunk needs to know about the run."""

    cfg: ModelConfig
    ps: ParallelState
    tp_random: TPRandom
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_layers: int | None = None
    cp_comm: str = "p2p"
    deferral: Deferral = field(default_factory=Deferral)
    """Where the model's linears put their weight gradients during a split backward's B step
    (the pipeline executor opens it)."""
    float8: Float8Training | None = None
    """`train.fp8`: the linears' and experts' GEMMs in float8 (None: the compute dtype)."""

    def linear_pair(self) -> LinearPair:
        """What a layer hands both its column- and its row-parallel linear (the SP partner and
        this model's `deferral` reach their backward through it, not through globals)."""
        return LinearPair(self.deferral)

    @property
    def out_proj_init(self) -> InitFn:
        """GPT-2's scaled init for projections that write into the residual stream."""
        return normal_init(self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers))


def dropout(
    x: torch.Tensor, p: float, training: bool, ctx: BuildContext, split: bool
) -> torch.Tensor:
    """Dropout whose mask differs over tp ranks exactly when the activation is split over them."""
    if p == 0.0 or not training:
        return x
    if split:
        with ctx.tp_random.fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class ResidualDropout(nn.Module):
    """Dropout on the residual stream (the activations between blocks, sequence shards under
    SP), so its masks differ over tp ranks exactly when SP splits the stream."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.ctx.cfg.dropout, self.training, self.ctx, self.ctx.sequence_parallel)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias; under SP each rank normalises its own sequence shard, so
    the (replicated) parameters get partial gradients that are summed over tp after backward."""

    def __init__(self, hidden: int, ctx: BuildContext, bias: bool = True) -> None:
        super().__init__()
        self.eps = ctx.cfg.norm_eps
        partial = ctx.sequence_parallel
        meta = dict(tp_grad_reduce=partial, weight_decay=False)
        self.weight = make_param(
            (hidden,), ParamMeta((hidden,), constant_init(1.0), **meta), ctx.ps
        )
        self.bias = (
            make_param((hidden,), ParamMeta((hidden,), constant_init(0.0), **meta), ctx.ps)
            if bias
            else None
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (h, norm(h)) for h = x + residual, added in the same pass
        (one fused kernel on GPU)."""
        h, y = layer_norm(x, self.weight, self.bias, self.eps, residual=residual)
        return y if residual is None else (h, y)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (Llama); x / rms(x) * (1 + weight) with
    `unit_offset` (Gemma)."""

    def __init__(
        self, hidden: int, ctx: BuildContext, over_heads: bool = False, unit_offset: bool = False
    ) -> None:
        """`over_heads`: normalise each attention head (QK-norm, one weight of head_dim for
        every head), whose gradient each tp rank holds for its own heads only. `unit_offset`:
        scale by 1 + weight, the weight initialised to 0 (Gemma's RMSNorm)."""
        super().__init__()
        self.eps, self.unit_offset = ctx.cfg.norm_eps, unit_offset
        partial = over_heads or ctx.sequence_parallel
        init = constant_init(0.0 if unit_offset else 1.0)
        meta = ParamMeta((hidden,), init, tp_grad_reduce=partial, weight_decay=False)
        self.weight = make_param((hidden,), meta, ctx.ps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (h, norm(h)) for h = x + residual, as LayerNorm does."""
        if not self.unit_offset:
            h, y = rms_norm(x, self.weight, self.eps, residual=residual)
            return y if residual is None else (h, y)
        # 1 + w in fp32 (in 16 bits a small w would round away), the product rounded once to
        # x's dtype; the gradient reaches w through the sum
        h, y = rms_norm(x, 1.0 + self.weight.float(), self.eps, residual=residual)
        y = y.to(x.dtype)
        return y if residual is None else (h, y)


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's rope scaling (`model.rope_scaling=llama3`): measured against the pretraining
    context, a frequency with fewer than `low_freq_factor` periods in it is slowed
    `factor` times, one with more than `high_freq_factor` is kept, and one in between is slowed
    by a factor interpolated linearly in its period count."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    @staticmethod
    def of(cfg: ModelConfig) -> Llama3Scaling | None:
        """The scaling the config asks for; None for plain rotary embeddings."""
        if cfg.rope_scaling == "none":
            return None
        return Llama3Scaling(
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_positions,
        )

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (radians per position)."""
        periods = self.original_max_positions * inv_freq / (2 * math.pi)  # in the old context
        span = self.high_freq_factor - self.low_freq_factor
        kept = ((periods - self.low_freq_factor) / span).clamp(0.0, 1.0)  # 0: slowed, 1: kept
        return inv_freq * (kept + (1.0 - kept) / self.factor)


@dataclass(frozen=True)
class LinearScaling:
    """Linear rope scaling (position interpolation, Chen et al. 2023): every frequency slowed
    `factor` times, as if each position were divided by it (Gemma 3's global layers,
    `model.rope_linear_factor`)."""

    factor: float

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        return inv_freq / self.factor


def rotary_tables(
    head_dim: int,
    positions: int,
    theta: float,
    scaling: Llama3Scaling | LinearScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (positions, head_dim) in the Hugging Face `rotate_half` layout, with the
    frequencies `scaling` rescales (`Llama3Scaling.of(cfg)`); computed in float64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        inv_freq = scaling.scale(inv_freq)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, scale: float | None = None
) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v (scale: 1 / sqrt(d) by default) with dropout on the
    probabilities; materialises the (s x s) scores, which is why it is only used when attention
    dropout is on."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd)
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (b, heads, s, s)
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # kept in the input dtype
    probs = F.dropout(probs, p, True)
    return (probs @ v).transpose(1, 2)  # (b, s, heads, hd)


class Attention(nn.Module):
    """Causal self-attention with heads split over tp ranks: q/k/v one fused column-parallel
    linear, the output projection row-parallel. Grouped-query attention keeps n_kv_heads
    key/value heads; when there are fewer kv heads than tp ranks, each rank computes the one its
    query heads use."""

    def __init__(
        self,
        ctx: BuildContext,
        *,
        bias: bool,
        rotary: bool,
        qk_norm: bool = False,
        qkv_bias: bool = False,
        window: int | None = None,
        unit_offset: bool = False,
        softmax_scale: float | None = None,
        rope_theta: float | None = None,
        rope_scaling: Llama3Scaling | LinearScaling | None = None,
    ) -> None:
        """`bias`: every projection has one (GPT-2); `qkv_bias`: q, k and v only (Qwen2);
        `qk_norm`: RMSNorm each head of q and of k before rotary (Qwen3, Gemma 3), scaling by 1 +
        weight with `unit_offset` (Gemma 3); `window`: a sliding window of keys (Mistral; None:
        every earlier token); `softmax_scale`: the scores' scale (None: head_dim ** -0.5);
        `rope_theta`, `rope_scaling`: this attention's rotary base and frequency scaling in place
        of the config's (`model.rope_theta`, `Llama3Scaling.of(cfg)`: Gemma 3's local and global
        layers differ)."""
        super().__init__()
        cfg, ps, tp = ctx.cfg, ctx.ps, ctx.ps.size("tp")
        self.ctx, self.rotary, self.head_dim, self.window = ctx, rotary, cfg.head_dim, window
        self.softmax_scale = softmax_scale
        init = normal_init(cfg.init_std)
        sp, pair = ctx.sequence_parallel, ctx.linear_pair()
        linear = dict(init=init, sequence_parallel=sp, pair=pair, float8=ctx.float8)
        # q, k and v are one weight: one GEMM. With fewer kv heads than tp ranks each rank
        # holds every kv head and computes the one its query heads use.
        kv_width, shared = cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads < tp
        kv_heads = cfg.n_kv_heads if shared else 0
        qkv = [ColumnOutput("wq", cfg.q_width), ColumnOutput("wk", kv_width, kv_heads)]
        qkv.append(ColumnOutput("wv", kv_width, kv_heads))
        self.wqkv = FusedColumnParallelLinear(cfg.hidden, qkv, ps, bias=bias or qkv_bias, **linear)
        self.wo = RowParallelLinear(
            cfg.q_width,
            cfg.hidden,
            ps,
            bias=bias,
            init=ctx.out_proj_init,
            sequence_parallel=sp,
            pair=pair,
            float8=ctx.float8,
        )
        norm = dict(over_heads=True, unit_offset=unit_offset)
        self.q_norm = RMSNorm(cfg.head_dim, ctx, **norm) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, ctx, **norm) if qk_norm else None
        if rotary:
            scaling = Llama3Scaling.of(cfg) if rope_scaling is None else rope_scaling
            theta = cfg.rope_theta if rope_theta is None else rope_theta
            cos, sin = rotary_tables(cfg.head_dim, cfg.max_positions, theta, scaling)
            self.register_buffer("cos", cos.to(ps.device), persistent=False)
            self.register_buffer("sin", sin.to(ps.device), persistent=False)

    def forward(self, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        """x: the block's normed input; `layout`: which pieces of the windows its tokens are
        and their documents (None: whole windows, one document each)."""
        q, k, v = self.wqkv(x)  # one gather, one GEMM: (b, s, local heads * hd) each
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.head_dim)  # (b, s, local heads, hd)
        k = k.view(b, s, -1, self.head_dim)  # (b, s, local kv heads, hd)
        v = v.view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = self.rotate(q, k, layout)
            # q and k are new tensors now; a copy of v lets the fused output go (attention
            # keeps v for backward, and a view would keep q/k/v's whole output alive)
            v = v.contiguous()
        y = self.core(q, k, v, layout)  # (b, s, local heads, hd)
        return self.wo(y.reshape(b, s, -1))

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of q and k at their tokens' positions, in one pass over both."""
        if layout is None or layout.plain:
            return rotary_embedding(q, k, self.cos, self.sin)  # positions 0..s-1
        b, s = q.shape[:2]
        positions = layout.positions.expand(b, s).reshape(-1)  # one table row per token
        q, k = rotary_embedding(
            q.reshape(1, b * s, *q.shape[2:]),
            k.reshape(1, b * s, *k.shape[2:]),
            self.cos[positions],
            self.sin[positions],
        )
        return q.view(b, s, *q.shape[2:]), k.view(b, s, *k.shape[2:])

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout | None
    ) -> torch.Tensor:
        scale = self.softmax_scale
        if layout is not None and not layout.plain:  # pieces of windows, or documents
            ps = self.ctx.ps
            ring = (ps.ranks("cp"), ps.coord("cp"), ps.group("cp"), self.ctx.cp_comm)
            return chunked_attention(q, k, v, layout, *ring, self.window, scale)
        p = self.ctx.cfg.dropout if self.training else 0.0
        if p == 0.0:
            return flash_attention(q, k, v, causal=True, softmax_scale=scale, window=self.window)
        tp_random = self.ctx.tp_random

        def dropped(q, k, v):
            with tp_random.fork():  # local heads differ per rank: so do their masks
                return math_attention(q, k, v, p, scale)

        if self.ctx.recompute == "selective":  # Korthikanti et al.: drop the s x s tensors
            return recompute(dropped, q, k, v, tp_random=tp_random)
        return dropped(q, k, v)
