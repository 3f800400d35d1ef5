"""The run configuration: dataclasses with a docstring under every field, loaded from YAML plus
dotted command-line overrides (`train.steps=50 parallel.tp=2`).

Loading is strict so that a typo never silently trains the wrong model: an unknown key names
the closest valid ones, every value is type-checked, and ranges and cross-field constraints are
checked in `__post_init__` before any work starts. Constraints that need the world size (tp * pp
dividing it, which the rank grid `parallel_dims` checks, and the pipeline schedule's rules on the
micro-batch count that follows) are checked by `Config.layout_for_world`. The pipeline
schedule's rules belong to `pipeline.schedule` (which imports no torch, so config errors still
come before torch is imported); this module runs them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megalite import architectures
from megalite.errors import ConfigError
from megalite.parallel_dims import ParallelDims
from megalite.pipeline.schedule import ScheduleError, check_chunks, check_microbatches


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _schedule_rule(check: Callable[..., Any], *args: Any) -> Any:
    """Run one of `pipeline.schedule`'s checks, its error as a config error."""
    try:
        return check(*args)
    except ScheduleError as error:
        raise ConfigError(str(error)) from None


def _moe_architectures() -> list[str]:
    """The registered architectures whose MLPs are mixtures of experts."""
    return [n for n in architectures.names() if architectures.architecture(n).mixture_of_experts]


def _one_of(names: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def _allowing(capability: str) -> list[str]:
    """The registered architectures whose record has `capability` (an `Architecture` flag)."""
    return [n for n in architectures.names() if getattr(architectures.architecture(n), capability)]


ROPE_SCALING_DEFAULTS: dict[str, dict[str, float | int]] = {
    "none": {},
    "llama3": {
        "rope_scaling_factor": 8.0,
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
        "rope_original_max_positions": 8192,
    },
}
"""The kinds of `model.rope_scaling`, each with its parameters' defaults (Llama 3.1's)."""
ROPE_SCALING_KEYS = tuple(ROPE_SCALING_DEFAULTS["llama3"])
"""The `ModelConfig` fields that parameterise rope scaling."""


@dataclass
class ModelConfig:
    arch: str = "gpt"
    """The architecture, by its name in `megalite.architectures`: `gpt` (GPT-2), `llama` or
    `mixtral` (Llama with a mixture of experts) as shipped; each package under models/ says
    what it is."""
    n_layers: int = 4
    """Number of transformer layers."""
    hidden: int = 256
    """Model width h."""
    n_heads: int = 4
    """Attention (query) heads; hidden must be divisible by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (where the architecture has it); None means
    n_heads."""
    head_dim: int | None = None
    """Width of each attention head; None means hidden / n_heads. Architectures whose record
    allows it (qwen3) may set another, and q is then n_heads * head_dim wide (Qwen3-0.6B: 128
    at hidden 1024 and 16 heads)."""
    tie_embeddings: bool = False
    """Whether the LM head is the token embedding's weight (Hugging Face's
    `tie_word_embeddings`: Qwen3's models up to 4B). Architectures whose record allows it
    (qwen3); GPT's head is always tied, Llama's never."""
    sliding_window: int | None = None
    """Sliding-window attention (Mistral 7B v0.1: 4096): a token attends to itself and the
    window - 1 tokens before it (Hugging Face's `sliding_window`), on the layers
    `sliding_window_pattern` picks. Architectures whose record allows it (mistral)."""
    sliding_window_pattern: int | None = None
    """Which layers the window applies to: None every layer; n every layer but each n-th
    (layer i is global when (i + 1) % n == 0: Gemma 3's 6, five local layers to one global;
    GPT-OSS's 2, alternating)."""
    query_scale: float | None = None
    """Attention scores are scaled by query_scale ** -0.5 (Gemma 3's `query_pre_attn_scalar`:
    256 at head_dim 256, 168 in 27B at head_dim 128). None: head_dim. Architectures whose
    record allows it (gemma3)."""
    rope_local_theta: float | None = None
    """Rotary base of the windowed layers (Gemma 3's `rope_local_base_freq`, 10000, where the
    global layers take rope_theta, 1e6). None: rope_theta. Architectures whose record allows
    it (gemma3)."""
    rope_linear_factor: float | None = None
    """Linear rope scaling of the global (unwindowed) layers: their rotary frequencies divided
    by this (Gemma 3 4B and up: 8; Hugging Face's rope_type linear). None: unscaled.
    Architectures whose record allows it (gemma3)."""
    ffn_hidden: int | None = None
    """MLP inner width; None means the architecture's default (GPT-2's 4*hidden, Llama's
    8/3*hidden rounded up to a multiple of 64)."""
    vocab_size: int = 8000
    """Tokenizer vocabulary; the embedding is padded to a multiple of tp * vocab_round_to."""
    vocab_round_to: int = 128
    """Embedding rows are padded to a multiple of tp times this (padding is never predicted)."""
    seq_len: int = 256
    """Tokens per training sample: the context length training runs at."""
    max_positions: int | None = None
    """Positions the model can represent (GPT-2's `n_positions`, Llama's
    `max_position_embeddings`): GPT's learned position table has this many rows and Llama's
    rotary tables cover them; `generate` may use this much context. None means seq_len, except
    that `checkpoint.init_from` adopts the model's own (GPT-2: 1024, kept whatever seq_len
    trains at), as it does the rotary settings below; setting it there asks for that count."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches (0 makes layouts comparable)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """Rotary embedding base (architectures with rotary embeddings)."""
    rope_scaling: str = "none"
    """Rotary frequency scaling, to run at a longer context than the model was pretrained at:
    none, or llama3 (Llama 3.1's: wavelengths longer than rope_original_max_positions /
    rope_low_freq_factor are stretched rope_scaling_factor times, those shorter than
    rope_original_max_positions / rope_high_freq_factor kept, those between interpolated).
    Architectures whose record allows it (llama); Hugging Face's `rope_scaling` /
    `rope_parameters` with rope_type llama3."""
    rope_scaling_factor: float | None = None
    """llama3: how many times longer the context is than at pretraining (>= 1). None: Llama
    3.1's 8 with rope_scaling=llama3. With rope_scaling=none it stays unset, as do the three
    below."""
    rope_low_freq_factor: float | None = None
    """llama3: wavelengths above rope_original_max_positions / this are stretched in full.
    None: Llama 3.1's 1."""
    rope_high_freq_factor: float | None = None
    """llama3: wavelengths below rope_original_max_positions / this are kept; above
    rope_low_freq_factor. None: Llama 3.1's 4."""
    rope_original_max_positions: int | None = None
    """llama3: the context length of pretraining (Hugging Face's
    `original_max_position_embeddings`). None: Llama 3.1's 8192."""
    init_std: float = 0.02
    """Standard deviation of the normal init; output projections use init_std/sqrt(2*n_layers)."""
    moe_experts: int | None = None
    """Mixture-of-experts architectures (mixtral): routed experts per layer, each a SwiGLU MLP of
    width ffn_hidden (Mixtral 8x7B: 8). None on dense architectures."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_router: str = "softmax"
    """softmax: Mixtral's top-k of softmax probabilities, gates renormalised over the k.
    sigmoid: DeepSeek-V3's sigmoid scores, top-k chosen with a per-expert bias
    (moe_bias_update_rate), gates the chosen scores normalised, times moe_routed_scale."""
    moe_shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek's shared experts), run
    as one SwiGLU MLP of width moe_shared_experts * ffn_hidden."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch / Mixtral: E * sum_i f_i P_i per layer, over
    each micro-batch's tokens) in the training objective; 0 turns it off."""
    moe_z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE: mean squared log-sum-exp of the router logits)."""
    moe_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3, sigmoid router): after each step every
    expert's routing bias moves this much towards balance (0.001 in DeepSeek-V3); 0: off."""
    moe_routed_scale: float = 1.0
    """Factor on the routed experts' gates (DeepSeek-V3's routed_scaling_factor)."""
    moe_capacity_factor: float | None = None
    """None: dropless (every routed token is computed). A number: each expert takes at most
    ceil(factor * tokens * top_k / experts) of a micro-batch's tokens, first choices first;
    the rest are dropped (their gate is zero) and counted in the metrics."""

    def __post_init__(self) -> None:
        _require(
            self.arch in architectures.names(),
            f"model.arch must be {_one_of(architectures.names())}, got {self.arch!r}",
        )
        arch = architectures.architecture(self.arch)
        for name in ("n_layers", "hidden", "n_heads", "vocab_size", "seq_len", "vocab_round_to"):
            _require(getattr(self, name) >= 1, f"model.{name} must be >= 1")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.max_positions is None:
            self.max_positions = self.seq_len
        _require(
            self.seq_len <= self.max_positions,
            f"model.seq_len ({self.seq_len}) exceeds model.max_positions ({self.max_positions}): "
            f"raise model.max_positions to at least {self.seq_len} or lower model.seq_len",
        )
        if self.ffn_hidden is None:
            self.ffn_hidden = arch.default_ffn_hidden(self.hidden)
        _require(self.ffn_hidden >= 1, "model.ffn_hidden must be >= 1")
        if self.head_dim is None:
            _require(
                self.hidden % self.n_heads == 0,
                f"model.hidden ({self.hidden}) must be divisible by model.n_heads "
                f"({self.n_heads}), or set model.head_dim",
            )
            self.head_dim = self.hidden // self.n_heads
        _require(
            self.head_dim == self.hidden // self.n_heads or arch.any_head_dim,
            f"model.head_dim ({self.head_dim}) differs from hidden / n_heads, which only "
            f"{_one_of(_allowing('any_head_dim'))} allow",
        )
        _require(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim must be even")
        _require(
            self.sliding_window is None or arch.sliding_window,
            f"model.sliding_window is for {_one_of(_allowing('sliding_window'))}",
        )
        _require(
            self.sliding_window is None or self.sliding_window >= 1,
            f"model.sliding_window must be >= 1 (or null: full attention), got "
            f"{self.sliding_window}",
        )
        _require(
            self.sliding_window_pattern is None
            or (self.sliding_window is not None and self.sliding_window_pattern >= 1),
            "model.sliding_window_pattern picks the windowed layers: set model.sliding_window "
            "too, and a pattern >= 1",
        )
        _require(
            self.sliding_window is None or self.dropout == 0.0,
            "model.dropout drops attention probabilities, which sliding-window attention never "
            "materialises: set model.dropout=0",
        )
        for name, flag in (
            ("query_scale", "query_scale"),
            ("rope_local_theta", "layer_rope"),
            ("rope_linear_factor", "layer_rope"),
        ):
            _require(
                getattr(self, name) is None or getattr(arch, flag),
                f"model.{name} is for {_one_of(_allowing(flag))}, not model.arch={self.arch}: "
                "leave it out",
            )
        for name in ("query_scale", "rope_local_theta"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"model.{name} must be > 0 (or null), got {value}")
        _require(
            self.rope_linear_factor is None or self.rope_linear_factor >= 1,
            "model.rope_linear_factor must be >= 1 (the context is that many times "
            f"pretraining's), or null, got {self.rope_linear_factor}",
        )
        _require(
            not self.tie_embeddings or arch.tie_option,
            f"model.tie_embeddings is for {_one_of(_allowing('tie_option'))} (GPT's head is "
            "always tied)",
        )
        _require(
            self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
            f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads ({self.n_heads})",
        )
        _require(
            arch.grouped_query or self.n_kv_heads == self.n_heads,
            "model.n_kv_heads differs from n_heads, but grouped-query attention is "
            f"only in {_one_of(_allowing('grouped_query'))}",
        )
        _require(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        for name in ("norm_eps", "rope_theta"):
            _require(
                getattr(self, name) > 0, f"model.{name} must be > 0, got {getattr(self, name)}"
            )
        _require(self.init_std >= 0, f"model.init_std must be >= 0, got {self.init_std}")
        self._check_rope_scaling(arch)
        self._check_experts(arch)

    def _check_experts(self, arch: architectures.Architecture) -> None:
        """The moe_* settings are set on a mixture-of-experts architecture, and only there."""
        if not arch.mixture_of_experts:
            _require(
                self.moe_experts is None,
                f"model.moe_experts is set, but model.arch={self.arch} has dense MLPs: use a "
                f"mixture-of-experts architecture ({_one_of(_moe_architectures())}) or leave "
                "it out",
            )
            return
        _require(
            self.moe_experts is not None and self.moe_experts >= 1,
            f"model.arch={self.arch} needs model.moe_experts (routed experts per layer) >= 1",
        )
        _require(
            1 <= self.moe_top_k <= self.moe_experts,
            f"model.moe_top_k must be in [1, moe_experts={self.moe_experts}], got {self.moe_top_k}",
        )
        routers = ["softmax", "sigmoid"]
        _require(
            self.moe_router in routers,
            f"model.moe_router must be {_one_of(routers)}, got {self.moe_router!r}",
        )
        _require(
            self.moe_bias_update_rate == 0.0 or self.moe_router == "sigmoid",
            "model.moe_bias_update_rate balances the sigmoid router's choices: set "
            "model.moe_router=sigmoid, or model.moe_bias_update_rate=0",
        )
        for name in ("moe_shared_experts", "moe_aux_loss_coef", "moe_z_loss_coef"):
            _require(getattr(self, name) >= 0, f"model.{name} must be >= 0")
        _require(
            self.moe_capacity_factor is None or self.moe_capacity_factor > 0,
            "model.moe_capacity_factor must be > 0, or unset (dropless)",
        )

    def _check_rope_scaling(self, arch: architectures.Architecture) -> None:
        """rope_scaling names a kind megalite implements, on an architecture that has it; the
        llama3 parameters default to Llama 3.1's and are in range."""
        kinds = list(ROPE_SCALING_DEFAULTS)
        _require(
            self.rope_scaling in kinds,
            f"model.rope_scaling must be {_one_of(kinds)}, got {self.rope_scaling!r}",
        )
        defaults = ROPE_SCALING_DEFAULTS[self.rope_scaling]
        if not defaults:
            given = [f"model.{key}" for key in ROPE_SCALING_KEYS if getattr(self, key) is not None]
            if given:
                raise ConfigError(
                    f"{_one_of(given)} {'are' if given[1:] else 'is'} set, but "
                    f"model.rope_scaling=none: set model.rope_scaling={_one_of(kinds[1:])} to "
                    f"scale, or leave {'them' if given[1:] else 'it'} out"
                )
            return
        _require(
            arch.rope_scaling,
            f"model.rope_scaling={self.rope_scaling}, but rope scaling is only in "
            f"{_one_of(_allowing('rope_scaling'))} (model.arch={self.arch} has no rotary "
            "embeddings to scale): set model.rope_scaling=none",
        )
        for key, value in defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        _require(
            self.rope_scaling_factor >= 1,
            f"model.rope_scaling_factor must be >= 1 (the context is that many times "
            f"pretraining's), got {self.rope_scaling_factor}",
        )
        _require(
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
            "need 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, got "
            f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}: set both (Llama "
            "3.1: 1 and 4)",
        )
        _require(
            self.rope_original_max_positions >= 1,
            "model.rope_original_max_positions must be >= 1",
        )

    @property
    def q_width(self) -> int:
        """Output width of the query projection, and input width of the output one."""
        return self.n_heads * self.head_dim

    def window_of(self, layer: int) -> int | None:
        """The sliding window of global layer `layer`, None where it attends to every earlier
        token (`sliding_window`, `sliding_window_pattern`)."""
        pattern = self.sliding_window_pattern
        if self.sliding_window is None or (pattern is not None and (layer + 1) % pattern == 0):
            return None
        return self.sliding_window


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: ranks that split every layer's heads and MLP columns."""
    cp: int = 1
    """Context-parallel size: ranks that split every sequence (in 2*cp chunks, rank i holding
    chunks i and 2cp-1-i so the causal work is balanced); attention sees the other ranks' keys
    and values through `cp_comm`. Gradients are reduced over dp x cp."""
    cp_comm: str = "p2p"
    """How context-parallel attention reaches the other chunks: p2p (ring attention: K/V blocks
    passed around the cp ranks, each overlapped with a block of compute, partial outputs merged
    by their log-sum-exp) or allgather (every rank gathers the whole sequence's K/V, as Llama 3
    trained: one collective, memory of the full K/V, cheap with few kv heads)."""
    pp: int = 1
    """Pipeline-parallel size: stages the layers are cut into."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): the data-parallel ranks of each dp
    group are cut into groups of ep, over which every layer's experts are sharded (each rank
    holds moe_experts / ep of them) and tokens travel to their experts and back by all-to-all.
    Must divide the data-parallel size and model.moe_experts. Expert gradients are reduced over
    the dp x cp ranks holding the same experts."""
    reshard_after_forward: bool = True
    """ZeRO-3: free each block's gathered parameters after its forward (and gather them again
    for its backward); false keeps them until the step's gradients are reduced (FSDP2's
    option): one gather a step instead of two per micro-batch, for the stage's full
    parameters held through the step. Worth it with pipeline parallelism's several
    micro-batches per stage."""
    dp_replicate: int = 1
    """Hybrid sharding (HSDP; torchtitan's data_parallel_replicate_degree): ZeRO shards within
    groups of dp / dp_replicate ranks and keeps dp_replicate copies of each shard, so its
    all-gathers stay inside a group (a node) and only the gradients' all-reduce of the owned
    shards crosses the groups. Needs parallel.zero >= 1 and must divide dp. Experts shard
    over all their replicas."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline rank (interleaved schedule; zb-v: 2)."""
    sp: bool = False
    """Sequence parallelism: norms, dropout and residuals run on sequence shards (needs tp > 1)."""
    zero: int = 0
    """0: every data-parallel rank keeps the full optimizer; 1: shard master weights and Adam
    state over data-parallel ranks (ZeRO-1); 2: shard the fp32 gradients too (ZeRO-2); 3: shard
    the 16-bit parameters too (ZeRO-3, FSDP), each block's gathered for its forward and again
    for its backward (data_parallel/zero3.py)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, zb-h1 (1F1B with each backward split into
    input and weight gradients, the weight gradients moved into the bubble: a third of 1F1B's
    at the same activation memory) or zb-v (two chunks per rank in a V, vpp=2: almost no
    bubble at 1F1B's activation memory)."""
    microbatch_group_size: int | None = None
    """Interleaved schedule with vpp > 1: micro-batches run in groups of this size (default
    pp); other schedules refuse it."""
    embedding_layer_weight: float | None = None
    """Count the embedding as this fraction of a transformer layer when balancing pipeline
    stages; None: from the model's FLOPs (a lookup, so 0)."""
    head_layer_weight: float | None = None
    """Count the final norm + head + loss as this fraction of a layer when balancing pipeline
    stages; None: from the model's FLOPs (the head's matmul over the vocabulary against one
    layer's matmuls and attention; several layers' worth on a small model)."""
    bucket_mb: float = 40.0
    """Gradient bucket size (MB of fp32) for the overlapped data-parallel reduction."""

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "ep", "dp_replicate"):
            _require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1")
        _require(
            self.cp_comm in ("p2p", "allgather"),
            f"parallel.cp_comm must be p2p or allgather, got {self.cp_comm!r}",
        )
        _require(self.zero in (0, 1, 2, 3), f"parallel.zero must be 0, 1, 2 or 3, got {self.zero}")
        _require(
            self.reshard_after_forward or self.zero == 3,
            "parallel.reshard_after_forward=false keeps ZeRO-3's gathered parameters; at "
            f"parallel.zero={self.zero} they are never freed: set parallel.zero=3 or drop it",
        )
        _require(
            self.dp_replicate == 1 or self.zero >= 1,
            f"parallel.dp_replicate={self.dp_replicate} replicates ZeRO's shards, but "
            "parallel.zero=0 shards nothing: set parallel.zero to 1, 2 or 3, or "
            "parallel.dp_replicate=1",
        )
        _schedule_rule(check_chunks, self.schedule, self.pp, self.vpp)
        # The schedule also builds gpipe with virtual stages (evaluation runs their forwards);
        # training offers virtual stages only interleaved.
        _require(
            self.vpp == 1 or self.schedule != "gpipe",
            f"parallel.vpp={self.vpp} needs parallel.schedule=interleaved: training runs gpipe "
            "with one chunk per rank",
        )
        _require(self.bucket_mb > 0, "parallel.bucket_mb must be > 0")
        for name in ("embedding_layer_weight", "head_layer_weight"):
            weight = getattr(self, name)
            _require(
                weight is None or weight >= 0,
                f"parallel.{name} must be >= 0 (or omitted: from the model's FLOPs), got {weight}",
            )

    def dims(self, world_size: int) -> ParallelDims:
        """This layout's rank grid on `world_size` ranks (dp takes the rest), or the error that
        names the fix."""
        return ParallelDims.for_world(
            world_size,
            ep=self.ep,
            dp_replicate=self.dp_replicate,
            tp=self.tp,
            cp=self.cp,
            pp=self.pp,
        )


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps to train for."""
    micro_batch_size: int = 8
    """Samples per micro-batch on one data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel ranks (micro * accumulation * dp)."""
    seed: int = 1234
    """Seeds weights, data order and dropout; the same for every layout."""
    precision: str = "auto"
    """fp32, bf16, fp16 (dynamic loss scaling) or auto (bf16 on CUDA, fp32 on CPU)."""
    recompute: str = "none"
    """Activation recompute: none, selective (attention core), full (whole layers) or segments
    (Chen et al. 2016: keep about sqrt(L) segment inputs per chunk, rerun one segment at a
    time in backward; O(sqrt(L)) layers of activations for one extra forward)."""
    recompute_layers: int | None = None
    """With recompute=full: how many layers per chunk to recompute (None: all)."""
    eval_interval: int = 100
    """Evaluate every this many steps (and at the end); larger than steps means no evaluation."""
    eval_steps: int = 10
    """Batches of the held-out split per evaluation."""
    log_interval: int = 1
    """Write a metrics row every this many steps."""
    out_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, checkpoints."""
    device: str = "auto"
    """auto (CUDA when present), cpu or cuda."""
    compile: bool = False
    """torch.compile each transformer block (regional); the tensor- and pipeline-parallel
    communication stays eager between the compiled pieces (training/compile.py)."""
    fp8: str = "none"
    """Float8 GEMMs in the linears and experts (torch._scaled_mm; megalite/float8/): none,
    tensorwise (one scale per tensor; e4m3 activations and weights, e5m2 gradients) or rowwise
    (per-row scales, all e4m3). Scales come from the amax of the whole tensor, whatever the
    layout; master weights, norms, softmax, loss, LM head, router and embedding keep their
    precision. Needs CUDA compute capability 8.9+ (or the CPU)."""
    fp8_min_dim: int = 1024
    """With fp8: a linear whose smaller global dim (in or out features) is below this keeps
    its GEMMs in the compute dtype (small GEMMs gain nothing); 0 puts every one in float8."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size", "eval_steps"):
            _require(getattr(self, name) >= 1, f"train.{name} must be >= 1")
        _require(self.log_interval >= 1, "train.log_interval must be >= 1")
        _require(self.eval_interval >= 1, "train.eval_interval must be >= 1")
        _require(
            self.precision in ("auto", "fp32", "bf16", "fp16"),
            f"train.precision must be fp32, bf16, fp16 or auto, got {self.precision!r}",
        )
        _require(
            self.recompute in ("none", "selective", "full", "segments"),
            f"train.recompute must be none, selective, full or segments, got {self.recompute!r}",
        )
        _require(self.device in ("auto", "cpu", "cuda"), "train.device must be auto, cpu or cuda")
        _require(
            self.recompute_layers is None or self.recompute_layers >= 0,
            "train.recompute_layers must be >= 0",
        )
        _require(
            self.fp8 in ("none", "tensorwise", "rowwise"),
            f"train.fp8 must be none, tensorwise or rowwise, got {self.fp8!r}",
        )
        _require(self.fp8_min_dim >= 0, "train.fp8_min_dim must be >= 0 (0: every GEMM in fp8)")
        _require(
            self.fp8 == "none" or self.precision != "fp16",
            "train.fp8 needs train.precision bf16, fp32 or auto (float8 under fp16's loss "
            "scaling is not built): set train.precision=bf16, or train.fp8=none",
        )


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    decay_steps: int | None = None
    """Steps of the cosine decay after warmup ends (None: until train.steps)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms, biases)."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    offload: str = "none"
    """none, or cpu (ZeRO-Offload): the fp32 master weights and Adam moments live in host memory
    (what the copy engine moves is pinned on CUDA, in one arena per rank) and the update runs on
    the CPU, on the node's cores shared among its ranks; gradients go down and updated
    parameters come back bucket by bucket, overlapped with the CPU's update. At
    parallel.zero=3 the owned parameters live on the host too (ZeRO-Infinity's CPU tier), each
    brought up for its gather."""
    state_dtype: str = "fp32"
    """Storage of Adam's moments: fp32, or bf16 (half their memory; the update still computes
    in fp32, exp_avg rounded to nearest, exp_avg_sq stochastically). Master weights stay fp32."""

    def __post_init__(self) -> None:
        _require(self.lr > 0 and 0 <= self.min_lr <= self.lr, "need 0 <= optim.min_lr <= optim.lr")
        _require(self.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2 must be in [0, 1)")
        _require(self.weight_decay >= 0, "optim.weight_decay must be >= 0")
        _require(self.grad_clip >= 0, "optim.grad_clip must be >= 0 (0 disables clipping)")
        _require(self.eps > 0, "optim.eps must be > 0")
        _require(
            self.offload in ("none", "cpu"),
            f"optim.offload must be none or cpu, got {self.offload}",
        )
        _require(
            self.state_dtype in ("fp32", "bf16"),
            f"optim.state_dtype must be fp32 or bf16, got {self.state_dtype}",
        )
        _require(
            self.decay_steps is None or self.decay_steps >= 1,
            "optim.decay_steps must be >= 1 (or omitted: decay until train.steps)",
        )


@dataclass
class DataConfig:
    source: str = "builtin"
    """`builtin` (the packaged King James Bible) or the path prefix of data made by
    `megalite data prepare` (PREFIX.bin / PREFIX.idx.npy / PREFIX.json)."""
    tokenizer: str | None = None
    """Sentencepiece .model for a prepared source (used by generate); builtin brings its own."""
    val_fraction: float = 0.01
    """Fraction of the tokens held out for evaluation."""
    document_mask: bool = False
    """Attention never crosses a document boundary inside a packed window: the token after an
    end-of-document token starts a new document that sees nothing before it (Megatron's
    reset_attention_mask; Llama 3's pretraining). The loss of a window is then the sum of its
    documents' losses, each as if run alone."""
    reset_positions: bool = True
    """With document_mask: positions restart at 0 at each document (Megatron's
    reset_position_ids); false keeps the window's positions."""

    def __post_init__(self) -> None:
        _require(0 < self.val_fraction < 0.5, "data.val_fraction must be in (0, 0.5)")
        _require(
            self.source != "builtin" or self.tokenizer is None,
            f"data.tokenizer={self.tokenizer} is for prepared data, but data.source is builtin, "
            "which brings its own tokenizer: remove data.tokenizer, or set data.source to the "
            "prefix `megalite data prepare` wrote",
        )


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps (0: only at the end of training)."""
    resume: str = "auto"
    """auto (continue from <out_dir>/checkpoints/latest if present), none, or a checkpoint dir."""
    keep: int = 3
    """Newest checkpoints to keep (older ones are deleted), besides the newest good one and the
    good one before it, which no pruning deletes (the last good state, `checkpoint/writer.py`)."""
    init_from: str | None = None
    """Start a fresh run from these weights (a megalite checkpoint dir or a Hugging Face model
    dir) instead of random ones; the optimizer and data order start anew. The model's
    max_positions, rope_theta and rope scaling are adopted unless the config sets them; its
    other settings must match the config (the error names the overrides). Not used on resume."""
    async_save: bool = False
    """Write checkpoints in the background: a save waits only for a copy of the state in host
    memory (pinned on CUDA, so it needs that much free host memory); the checkpoint becomes
    `latest` after the first step at which every rank has written its files, and a crash
    before that leaves the previous one `latest`."""

    def __post_init__(self) -> None:
        _require(self.interval >= 0, "checkpoint.interval must be >= 0")
        _require(self.keep >= 1, "checkpoint.keep must be >= 1")
        _require(
            isinstance(self.async_save, bool),
            f"checkpoint.async_save must be true or false, got {self.async_save!r}",
        )


@dataclass
class LoggingConfig:
    run_name: str | None = None
    """The run's name in the trackers; None means the run directory's name."""
    wandb: bool = False
    """Also log to Weights & Biases: online after `wandb login` or with WANDB_API_KEY, offline
    (synced later with `wandb sync`) otherwise. A resumed run continues the same wandb run."""
    wandb_project: str = "megalite"
    """Weights & Biases project name."""
    wandb_entity: str | None = None
    """Weights & Biases team or user; None means your default entity."""
    wandb_group: str | None = None
    """Weights & Biases group, to see related runs together."""
    wandb_tags: str = ""
    """Weights & Biases tags, comma-separated."""
    tensorboard: bool = False
    """Also write TensorBoard event files under <out_dir>/tensorboard/<run name>."""
    progress: bool = True
    """Show a progress bar on the console."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s of one device (one GPU; on CPU the whole machine) that MFU divides by.
    None: the datasheet figure of a known GPU for train.precision, or this machine's measured
    peak on CPU (see megalite.hardware). Set it for a GPU missing from the table."""

    def __post_init__(self) -> None:
        _require(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"logging.peak_tflops must be a positive number of TFLOP/s, got {self.peak_tflops}",
        )


@dataclass
class FaultConfig:
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for its peers before the process group fails it (the gloo
    and NCCL time-out; NCCL then tears the process down). The backstop behind the watchdog."""
    watchdog_timeout_s: float | None = None
    """End the job when a rank makes no progress (no collective entered or completed, no step
    finished) for this long, naming the rank that went silent, its step and the last collective
    it entered; 0 turns the watchdog off, None means a third of collective_timeout_s. Must
    exceed the longest pause between collectives (the first step's compilation; a checkpoint
    save counts each 64 MiB it writes as progress) and stay below collective_timeout_s."""
    max_bad_steps: int = 5
    """Stop the run after this many bad steps in a row (a NaN/inf loss or gradient norm, or a
    loss spike), naming the step and the last good checkpoint. A bad step skips its update; no
    periodic checkpoint is saved during a streak, and one that must be (preemption, the last
    step) is saved as bad. A resume starts counting the streak afresh."""
    loss_spike_factor: float = 10.0
    """A loss above this many times the median of the recent good losses is a bad step; 0 turns
    spike detection off. The default catches a diverged run whose loss is still finite (5.8e12
    after 8.1); a healthy run's loss does not grow tenfold (from a median of 1.5, 15 is worse
    than a uniform guess over 128k tokens), so it costs nothing. Lower it (e.g. 3) to skip
    sharper spikes, as PaLM did."""
    loss_spike_window: int = 20
    """How many recent good losses the spike median is taken over (from the first good loss
    on: a short window's median errs high, towards letting a step pass)."""

    def __post_init__(self) -> None:
        _require(self.collective_timeout_s > 0, "fault.collective_timeout_s must be > 0")
        if self.watchdog_timeout_s is None:
            self.watchdog_timeout_s = self.collective_timeout_s / 3
        _require(
            self.watchdog_timeout_s >= 0, "fault.watchdog_timeout_s must be >= 0 (0 turns it off)"
        )
        _require(
            self.watchdog_timeout_s < self.collective_timeout_s,
            f"fault.watchdog_timeout_s ({self.watchdog_timeout_s}) must be below "
            f"fault.collective_timeout_s ({self.collective_timeout_s}), so that the watchdog "
            "names the silent rank before the collective fails: lower it or raise the other",
        )
        _require(self.max_bad_steps >= 1, "fault.max_bad_steps must be >= 1")
        _require(
            self.loss_spike_factor == 0 or self.loss_spike_factor > 1,
            f"fault.loss_spike_factor must be > 1 (or 0: off), got {self.loss_spike_factor}",
        )
        _require(self.loss_spike_window >= 1, "fault.loss_spike_window must be >= 1")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    explicit: typing.ClassVar[frozenset[str]] = frozenset()
    """The keys the YAML file and the overrides set ("model.max_positions"), as `build_config`
    read them, so that a default can be told from a choice (`checkpoint.init_from` adopts the
    model's own positions unless they were chosen). Not a setting: never saved; a Config built
    otherwise (or copied by `dataclasses.replace`) has none."""

    def __post_init__(self) -> None:
        m, p = self.model, self.parallel
        tp = p.tp
        for name, value in (
            ("model.n_heads", m.n_heads),
            ("model.ffn_hidden", m.ffn_hidden),
            ("model.hidden", m.hidden),
        ):
            _require(
                value % tp == 0,
                f"parallel.tp={tp} must divide {name}={value}: choose a tp that does",
            )
        _require(
            m.n_kv_heads % tp == 0 or tp % m.n_kv_heads == 0,
            f"parallel.tp={tp} and model.n_kv_heads={m.n_kv_heads}: one must divide the other",
        )
        _require(not p.sp or tp > 1, "parallel.sp=true needs parallel.tp > 1")
        if p.ep > 1:
            _require(
                m.moe_experts is not None,
                f"parallel.ep={p.ep} shards experts, but model.arch={m.arch} has none: use a "
                "mixture-of-experts architecture or parallel.ep=1",
            )
            _require(
                m.moe_experts % p.ep == 0,
                f"parallel.ep={p.ep} must divide model.moe_experts={m.moe_experts}: each rank "
                "holds the same number of experts",
            )
        _require(
            p.cp == 1 or m.seq_len % (2 * p.cp) == 0,
            f"parallel.cp={p.cp} cuts each sequence into 2*cp={2 * p.cp} chunks: model.seq_len "
            f"({m.seq_len}) must be divisible by {2 * p.cp}",
        )
        held = f"model.seq_len ({m.seq_len})"
        if p.cp > 1:
            held = f"the sequence a rank holds (model.seq_len / parallel.cp = {m.seq_len // p.cp})"
        _require(
            not p.sp or (m.seq_len // p.cp) % tp == 0,
            f"parallel.sp needs {held} divisible by parallel.tp ({tp})",
        )
        _require(
            m.dropout == 0.0 or (p.cp == 1 and not self.data.document_mask),
            f"model.dropout={m.dropout} drops attention probabilities, which context "
            "parallelism and document masking never materialise: set model.dropout=0",
        )
        chunks = p.pp * p.vpp
        _require(
            m.n_layers >= chunks,
            f"model.n_layers={m.n_layers} is fewer than pp*vpp={chunks} pipeline chunks",
        )

    def layout_for_world(self, world_size: int) -> tuple[int, int]:
        """Return (dp, micro-batches per step) for this world size, or fail clearly."""
        p, t = self.parallel, self.train
        dp = p.dims(world_size).sizes["dp"]
        per_step = t.micro_batch_size * dp
        _require(
            t.global_batch_size % per_step == 0,
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"micro_batch_size*dp = {t.micro_batch_size}*{dp}",
        )
        m = t.global_batch_size // per_step
        _schedule_rule(check_microbatches, p.schedule, p.pp, m, p.vpp, p.microbatch_group_size)
        return dp, m


# ----------------------------------------------------------------------------- loading


@functools.cache  # the planner builds thousands of configs; the annotations never change
def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


@functools.cache
def _section_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check a YAML/CLI value against the field's annotation (int, float, str, bool, X | None)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads 3e-3 as a string
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number
    if annotation is str and isinstance(value, str):
        return value
    if annotation is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ConfigError(  # YAML 1.1 read it as a number: 007 is 7, 0755 is 493, 12:30 is 750
            f'{key} must be text, but YAML read {value!r} as a number: quote it ({key}: "...")'
        )
    none = " (write null for none)" if value == "None" and args else ""
    raise ConfigError(
        f"{key} must be {getattr(annotation, '__name__', annotation)}, got {value!r}{none}"
    )


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    """Suggest the key of that name in another section, else the closest keys, comparing field
    names within the same section."""
    section, _, name = key.rpartition(".")
    elsewhere = [v for v in valid if section and v.rpartition(".")[2] == name]
    same_section = [v for v in valid if section and v.startswith(section + ".")]
    if elsewhere:
        return ConfigError(f"unknown config key {key!r}; did you mean {', '.join(elsewhere)}?")
    if same_section:
        names = {v.rpartition(".")[2]: v for v in same_section}
        close = [names[n] for n in difflib.get_close_matches(name, list(names), n=3, cutoff=0.5)]
        valid = same_section
    else:
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _all_keys() -> list[str]:
    return [
        f"{section}.{name}" for section, cls in _sections().items() for name in _section_types(cls)
    ]


def build_config(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested dict {section: {field: value}}."""
    sections = _sections()
    kwargs = {}
    for section, values in raw.items():
        if section not in sections:
            raise _unknown_key(section, list(sections))
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        hints = _section_types(sections[section])
        checked = {}
        for name, value in values.items():
            key = f"{section}.{name}"
            if name not in hints:
                raise _unknown_key(key, _all_keys())
            checked[name] = _coerce(key, value, hints[name])
        kwargs[section] = sections[section](**checked)
    config = Config(**kwargs)
    config.explicit = frozenset(f"{section}.{name}" for section, v in raw.items() for name in v)
    return config


def with_values(config: Config, values: dict[str, Any]) -> Config:
    """`config` with `section.key` values set, checked as `load_config` checks them: each value
    against its field, then the sections it changes and the whole config validated again. The
    other sections are shared with `config` (the planner derives thousands of layouts from one
    base)."""
    sections, changes = _sections(), {}
    for key, value in values.items():
        section, name = key.split(".")
        hints = _section_types(sections[section]) if section in sections else {}
        if name not in hints:
            raise _unknown_key(key, _all_keys())
        changes.setdefault(section, {})[name] = _coerce(key, value, hints[name])
    replaced = {}
    for section, changed in changes.items():  # rebuilt, so that derived fields follow
        old = getattr(config, section)
        kept = {
            field.name: getattr(old, field.name)
            for field in dataclasses.fields(old)
            if f"{section}.{field.name}" in config.explicit and field.name not in changed
        }
        replaced[section] = type(old)(**kept, **changed)
    derived = dataclasses.replace(config, **replaced)
    derived.explicit = config.explicit | frozenset(values)
    return derived


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.steps=50` -> (['train', 'steps'], 50); the value is parsed as YAML, except that
    a text field takes the text as typed (YAML would read `train.out_dir=007` as 7), `null`
    and an empty value meaning none."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"override key {key!r} must be section.key, e.g. train.steps")
    raw = value.strip()
    if not raw or raw in ("null", "~"):
        return parts, None
    if _is_text(*parts) and raw[0] not in "'\"":
        return parts, raw
    try:
        return parts, yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML ({_yaml_problem(exc)}); quote it"
        ) from None


def _is_text(section: str, name: str) -> bool:
    """Whether config field section.name holds text (str, or str | None)."""
    cls = _sections().get(section)
    annotation = _section_types(cls).get(name) if cls else None
    return str in (annotation, *typing.get_args(annotation))


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML config (or defaults when path is None) and apply dotted overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found (see configs/ for examples)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            problem = _yaml_problem(exc)
            raise ConfigError(f"config file {path} is not valid YAML: {problem}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must be a mapping of sections")
    for text in overrides:
        (section, name), value = parse_override(text)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        raw[section][name] = value
    return build_config(raw)


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's multi-line message (with an excerpt and a caret) as one phrase: where, then
    what, then the construct it was inside."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())
    mark, problem = exc.problem_mark, exc.problem or "syntax error"
    where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    if exc.context and exc.context_mark is not None:
        where += f" ({exc.context} from line {exc.context_mark.line + 1}, "
        where += f"column {exc.context_mark.column + 1})"
    return where


def config_to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def save_config(config: Config, path: Path) -> None:
    """Write the fully resolved config (defaults filled in) so a run can be reproduced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    tmp.replace(path)
