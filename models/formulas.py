"""What a model holds and computes, in closed form, without building it: the interface each
architecture's `formulas.py` implements (`Formulas`), and the facts of the shared blocks of
`models/layers.py` they are composed of. `megalite.profiling` asks these (the memory estimate,
FLOPs and MFU, the planner); `tests/unit/test_estimate.py` and
`tests/distributed/test_estimate_measured.py` hold them against built models and measurement.
Torch is not imported here: the planner reads FLOPs before it loads torch.

Parameters are one tp rank's, named and ordered as `chunk.named_parameters()` gives them.

Activations are the tensors autograd saves for backward, as `SavedActivationTracker` counts them
(Korthikanti et al. 2022 count a GPT layer with 16-bit activations and 1-byte dropout masks;
megalite's layers differ in ways that matter once the estimate is held against measurement):

- norms: LayerNorm keeps its input and two statistics per token; RMSNorm keeps its input and
  an fp32 1/rms per token with the Triton kernel, and with PyTorch's reference (computed in
  fp32) an fp32 copy of its input (the input itself in fp32), 1/rms per token and the
  normalised tensor before the weight; its output feeds the linears. The MLP's norm adds the
  attention residual in the same call: the sum is the input it keeps;
- column-parallel linears keep their input, one tensor for all that read it (q, k, v), under
  SP the sequence shard (gathered again in backward, as Megatron does);
- attention: with dropout 0 a flash kernel (Triton on GPU, SDPA on CPU) keeps q, k, v (k and v
  with the local kv heads: n_kv/tp, or the one head a rank computes when n_kv < tp), its output
  and a per-row fp32 log-sum-exp; so does the block attention of context parallelism and
  document masks (`context_parallel.attention`, ring or all-gather: only the local rows'); with
  dropout the math path keeps contiguous copies of q and of
  k, v repeated to every head, the scores' softmax, dropout mask and dropped probabilities
  (b * heads * s^2 each) and the s^2 causal mask; selective recompute keeps only q, k, v and
  the output;
- rotary embeddings at a chunk layout's positions (context parallelism, document masks) index
  the cos / sin tables by position: the two gathered (b * s, head_dim) copies are kept for
  backward (at positions 0..s-1 the tables themselves, module buffers, are);
- dropout masks are 1 byte on CUDA and the activation dtype on CPU; LayerNorm statistics fp32
  on CUDA and the activation dtype on CPU;
- under `train.fp8=tensorwise` a tensor-parallel linear in float8 keeps its input as a float8
  copy (1 byte per element) and two fp32 scales (its input's and its weight's) in place of the
  input: a column-parallel one's input and the MLP's down projection's are held by nothing
  else, so the copy replaces them; attention's output is kept by attention too, so its
  projection's copy comes on top. Rowwise keeps the input in the compute dtype, as torchao
  does, and casts it along the other dim in backward; the experts' float8 GEMMs keep what
  the grouped GEMM keeps.

Context parallelism (`parallel.cp`) gives each rank 2 of the 2*cp chunks of every window,
seq_len / cp tokens: every activation above is that of seq_len / cp tokens (`Shapes.seq`);
flash and ring attention keep no s x s term, and dropout, the one path with one, is refused
with cp (`Config` validation).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from megalite.architectures import architecture, load
from megalite.config import Config, ModelConfig
from megalite.float8 import takes_float8

INDEX_BYTES = 8
"""int64 token ids and positions."""
FLOAT8_SCALES = [4, 4]
"""A float8 linear's input and weight scales (fp32 scalars), kept with its float8 input."""


@dataclass(frozen=True)
class Shapes:
    """The sizes one rank's chunk works with, for one micro-batch."""

    cfg: Config
    element: int
    """Bytes per activation element (the training precision)."""
    device: str
    """"cuda" (Triton kernels, 1-byte dropout masks) or "cpu" (PyTorch references)."""

    @property
    def seq(self) -> int:
        """Tokens of one window on this rank: seq_len, or its 2 of the 2*cp chunks (seq_len / cp)
        under context parallelism."""
        return self.cfg.model.seq_len // self.cfg.parallel.cp

    @property
    def tokens(self) -> int:
        """Tokens of a micro-batch on this rank: what attention and the MLP see (the whole
        sequence, or this rank's seq_len / cp of it)."""
        return self.cfg.train.micro_batch_size * self.seq

    @property
    def chunked(self) -> bool:
        """Whether attention runs over a chunk layout (`context_parallel.layout`): context
        parallelism or document masks, which take the block attention and rotary at gathered
        positions instead of the flash kernel over positions 0..s-1."""
        return self.cfg.parallel.cp > 1 or self.cfg.data.document_mask

    @property
    def stream_tokens(self) -> int:
        """Tokens of the residual stream on this rank: a sequence shard under SP."""
        p = self.cfg.parallel
        return self.tokens // (p.tp if p.sp else 1)

    @property
    def local_heads(self) -> int:
        return self.cfg.model.n_heads // self.cfg.parallel.tp

    @property
    def local_kv_heads(self) -> int:
        n_kv, tp = self.cfg.model.n_kv_heads, self.cfg.parallel.tp
        return n_kv // tp if n_kv >= tp else 1

    @property
    def mask(self) -> int:
        return 1 if self.device == "cuda" else self.element

    @property
    def dropout(self) -> bool:
        return self.cfg.model.dropout > 0.0

    @property
    def ffn_activation(self) -> int:
        """Bytes of one MLP activation on this rank: (b, s, ffn_hidden / tp)."""
        return self.tokens * (self.cfg.model.ffn_hidden // self.cfg.parallel.tp) * self.element

    def float8_input(self, in_features: int, out_features: int) -> bool:
        """Whether a tensor-parallel linear of these global features keeps its input as a
        float8 copy (`train.fp8=tensorwise`, past `train.fp8_min_dim`)."""
        t = self.cfg.train
        return t.fp8 == "tensorwise" and takes_float8(t.fp8_min_dim, in_features, out_features)

    def kept_input(self, nbytes: int, in_features: int, out_features: int) -> int:
        """Bytes of what a tensor-parallel linear keeps of an input of `nbytes` in the compute
        dtype: the input, or its float8 copy (also what a split backward holds until W)."""
        return nbytes // self.element if self.float8_input(in_features, out_features) else nbytes

    def linear_input(self, nbytes: int, in_features: int, out_features: int) -> list[int]:
        """What a tensor-parallel linear keeps of an input of `nbytes`: the input, or its
        float8 copy and the scales."""
        scales = FLOAT8_SCALES if self.float8_input(in_features, out_features) else []
        return [self.kept_input(nbytes, in_features, out_features), *scales]

    def float8_copy(self, nbytes: int, in_features: int, out_features: int) -> list[int]:
        """What a linear keeps beside an input that another operation keeps anyway."""
        if self.float8_input(in_features, out_features):
            return [nbytes // self.element, *FLOAT8_SCALES]
        return []

    def mlp_down_input(self) -> list[int]:
        """What the MLP's row-parallel down projection keeps of its (b, s, ffn / tp) input."""
        m = self.cfg.model
        return self.linear_input(self.ffn_activation, m.ffn_hidden, m.hidden)


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    """On one tp rank."""
    own_bucket: bool = False
    """A tied embedding shared by the first and last pipeline stage gets a bucket of its own."""
    arrives_last: bool = False
    """Its gradient comes after all others of its chunk (GPT's token embedding: the position
    table, a leaf added after the lookup, is accumulated by autograd first)."""
    expert: bool = False
    """An MoE expert's (`ParamMeta.expert`): in a buffer of its own, replicated over dp / ep."""


def linear_parameters(prefix: str, rows: int, columns: int, bias: bool) -> list[Param]:
    """A linear layer's weight (rows x columns on this rank) and bias (rows)."""
    params = [Param(f"{prefix}.weight", rows * columns)]
    return params + [Param(f"{prefix}.bias", rows)] if bias else params


def attention_widths(cfg: Config) -> tuple[int, int]:
    """Output widths of this rank's query and key (or value) projections: its heads, or every
    kv head when there are fewer than tp ranks (each rank then computes the one it uses)."""
    m, tp = cfg.model, cfg.parallel.tp
    kv_heads = m.n_kv_heads // tp if m.n_kv_heads >= tp else m.n_kv_heads
    return m.q_width // tp, kv_heads * m.head_dim


def attention_parameters(
    cfg: Config, prefix: str, bias: bool, qkv_bias: bool = False
) -> list[Param]:
    """`layers.Attention`: q, k and v fused column-parallel, the output projection row-parallel;
    `bias` on both, `qkv_bias` on q, k and v only."""
    h = cfg.model.hidden
    q, kv = attention_widths(cfg)
    return [
        *linear_parameters(f"{prefix}.wqkv", q + 2 * kv, h, bias or qkv_bias),
        *linear_parameters(f"{prefix}.wo", h, q, bias),
    ]


def attention_matmul_weights(m: ModelConfig) -> int:
    """Weights of the attention's matmuls over the whole model width (all tp ranks)."""
    kv = m.n_kv_heads * m.head_dim
    return 2 * m.hidden * m.q_width + 2 * m.hidden * kv


def rotary_buffers(m: ModelConfig) -> list[int]:
    """Elements of the rotary cos and sin tables an attention with rotary holds."""
    return [m.max_positions * m.head_dim] * 2


def linear_input_saved(x: Shapes, out_features: int = 0) -> list[int]:
    """The input that column-parallel linears of `out_features` (global; 0: in the compute
    dtype whatever `train.fp8`) keep: (b, s, h), or the shard (b, s/tp, h) under SP."""
    nbytes, hidden = x.stream_tokens * x.cfg.model.hidden * x.element, x.cfg.model.hidden
    return x.linear_input(nbytes, hidden, out_features) if out_features else [nbytes]


def qkv_features(m: ModelConfig) -> int:
    """Global output features of the fused q/k/v linear."""
    return (m.n_heads + 2 * m.n_kv_heads) * m.head_dim


def attention_projection_copy(x: Shapes) -> list[int]:
    """The float8 copy of attention's output that its row-parallel projection keeps beside it
    (`train.fp8=tensorwise`)."""
    m = x.cfg.model
    nbytes = x.tokens * x.local_heads * m.head_dim * x.element
    return x.float8_copy(nbytes, m.q_width, m.hidden)


def attention_saved(x: Shapes) -> list[int]:
    """Attention's saved tensors after its input (q, k, v onwards, its output included)."""
    m = x.cfg.model
    t, e, b = x.tokens, x.element, x.cfg.train.micro_batch_size
    q = t * x.local_heads * m.head_dim * e
    kv = t * x.local_kv_heads * m.head_dim * e
    if not x.dropout:  # flash kernel, or the block attention (the same tensors)
        return [q, kv, kv, q, b * x.local_heads * x.seq * 4]
    if x.cfg.train.recompute == "selective":  # recompute keeps the inputs of the core attention
        return [q, kv, kv, q]
    probs = b * x.local_heads * m.seq_len**2
    return [q, q, q, q, probs * e, probs * x.mask, probs * e, m.seq_len**2]


def rotary_saved(x: Shapes) -> list[int]:
    """What rotary embeddings keep besides q and k: nothing at positions 0..s-1 (the tables are
    module buffers); over a chunk layout the cos and sin rows gathered at its positions."""
    return [x.tokens * x.cfg.model.head_dim * x.element] * 2 if x.chunked else []


def residual_masks(x: Shapes, branches: int) -> list[int]:
    """The dropout masks of `branches` residual branches (none without dropout)."""
    return [x.stream_tokens * x.cfg.model.hidden * x.mask] * branches if x.dropout else []


class Norm(ABC):
    """A norm of `models/layers.py`: its parameters and what it keeps for backward."""

    bias: bool

    def parameters(self, prefix: str, hidden: int) -> list[Param]:
        """Its weight, and its bias where it has one (replicated over tp)."""
        names = ("weight", "bias") if self.bias else ("weight",)
        return [Param(f"{prefix}.{name}", hidden) for name in names]

    @abstractmethod
    def keeps_input(self, x: Shapes) -> bool:
        """Whether its saved tensors include its input."""

    @abstractmethod
    def saved(self, x: Shapes, keeps_input: bool) -> list[int]:
        """Tensors it keeps besides its output: its input when `keeps_input` (when it is not
        already counted as held elsewhere)."""


class LayerNormFormulas(Norm):
    bias = True

    def keeps_input(self, x: Shapes) -> bool:
        return True

    def saved(self, x: Shapes, keeps_input: bool) -> list[int]:
        tr, h, e = x.stream_tokens, x.cfg.model.hidden, x.element
        stat = 4 if x.device == "cuda" else e
        return [tr * h * e] * keeps_input + [tr * stat] * 2


class RMSNormFormulas(Norm):
    bias = False

    def keeps_input(self, x: Shapes) -> bool:
        """Triton's always; PyTorch's in fp32, where its fp32 copy is the input."""
        return x.device == "cuda" or x.element == 4

    def saved(self, x: Shapes, keeps_input: bool) -> list[int]:
        tr, h, e = x.stream_tokens, x.cfg.model.hidden, x.element
        if x.device == "cuda":  # Triton's RMSNorm
            return [tr * h * e] * keeps_input + [tr * 4]
        fp32_input = [tr * h * 4] if (keeps_input or e != 4) else []  # in fp32 the input itself
        return fp32_input + [tr * 4, tr * h * e]


LAYER_NORM = LayerNormFormulas()
RMS_NORM = RMSNormFormulas()


def pre_norm_block_saved(
    x: Shapes,
    norm: Norm,
    mlp: list[int],
    rotary: bool = False,
    mlp_up_features: int = 0,
) -> list[int]:
    """What a pre-norm block x + attn(norm(x)), then + mlp(norm(...)), keeps without its input:
    the MLP's norm takes the attention's residual add with it, and keeps the sum when the norm
    keeps its input. `mlp`: the MLP's saved tensors after its input; `rotary`: whether its
    attention rotates q and k; `mlp_up_features`: the global output features of the MLP's
    first tensor-parallel linear (0: its input is kept in the compute dtype, as a mixture of
    experts' router keeps it)."""
    middle = [x.stream_tokens * x.cfg.model.hidden * x.element] if norm.keeps_input(x) else []
    return (
        norm.saved(x, keeps_input=False)
        + linear_input_saved(x, qkv_features(x.cfg.model))  # q, k, v
        + (rotary_saved(x) if rotary else [])
        + attention_saved(x)
        + attention_projection_copy(x)
        + residual_masks(x, 1)
        + middle
        + norm.saved(x, keeps_input=False)
        + linear_input_saved(x, mlp_up_features)  # the MLP's first linears
        + mlp
        + residual_masks(x, 1)
    )


class Formulas(ABC):
    """An architecture's closed forms: what the profiler asks instead of the architecture's
    name. Sizes are one tp rank's; `rows` is the embedding's (padded) vocabulary rows on it."""

    norm: Norm
    """The kind of its norms (the final one, and the first of each block)."""
    tied_embeddings: bool
    """Whether the LM head is the token embedding."""
    mlp_up_widths: int = 2
    """ffn-wide outputs of the MLP's first linear: gate and up (2), or GPT's fc (1)."""

    @abstractmethod
    def embedding_parameters(self, cfg: Config, rows: int, has_head: bool) -> list[Param]:
        """The first chunk's parameters before its blocks."""

    @abstractmethod
    def layer_parameters(self, cfg: Config, layer: int) -> list[Param]:
        """Block `layer`'s parameters (named `layers.<layer>.`...)."""

    @abstractmethod
    def layer_matmul_weights(self, m: ModelConfig) -> int:
        """Weights of one block that take part in a matmul per token (all tp ranks): 6 FLOPs
        each per token in training."""

    @abstractmethod
    def layer_saved(self, x: Shapes) -> list[int]:
        """Tensors one block keeps for backward, without its input (counted by the caller,
        since whether it is held depends on what comes before: a pipeline receive, a
        recompute)."""

    def ties(self, m: ModelConfig) -> bool:
        """Whether the LM head is the token embedding: always (`tied_embeddings`), or where the
        config says so (`model.tie_embeddings`)."""
        return self.tied_embeddings or m.tie_embeddings

    def head_parameters(self, cfg: Config, rows: int, has_embedding: bool) -> list[Param]:
        """The last chunk's parameters after its blocks: the final norm and the LM head (a tied
        head on the embedding's chunk is the embedding; elsewhere a copy with its own bucket)."""
        params = self.norm.parameters("final_norm", cfg.model.hidden)
        tied = self.ties(cfg.model)
        if not (tied and has_embedding):
            head = cfg.model.hidden * rows
            params.append(Param("lm_head.weight", head, own_bucket=tied))
        return params

    def mlp_deferred_inputs(self, x: Shapes) -> list[int]:
        """What the MLP's tensor-parallel linears hold from a split backward's B until its W
        (`profiling.activations.deferred_weight_inputs`): the first linear's input x and output
        gradient dy, then the down projection's (x a sequence shard under SP for the first,
        dy for the second)."""
        m = x.cfg.model
        wide = x.tokens * (m.ffn_hidden // x.cfg.parallel.tp) * x.element
        stream = x.stream_tokens * m.hidden * x.element
        up = x.kept_input(stream, m.hidden, self.mlp_up_widths * m.ffn_hidden)
        down = x.kept_input(wide, m.ffn_hidden, m.hidden)
        return [up, self.mlp_up_widths * wide, down, stream]

    def deferred_matmul_weights(self, m: ModelConfig) -> int:
        """Weights of one block (all tp ranks) whose gradient GEMM a split backward moves to W:
        those of its tensor-parallel linears, here every matmul weight of the block."""
        return self.layer_matmul_weights(m)

    def layer_buffers(self, m: ModelConfig) -> list[int]:
        """Elements of one block's non-parameter buffers."""
        return []

    def layer_keeps_input(self, x: Shapes) -> bool:
        """Whether a block's first operation (its norm) keeps the block's input."""
        return self.norm.keeps_input(x)

    def embedding_saved(self, x: Shapes) -> list[int]:
        """The embedding's saved tensors: token ids (this rank's chunks under cp; shifted to the
        rank's vocabulary piece, with a mask of the ids outside it, under tp) and its dropout
        mask."""
        ids = [x.tokens * INDEX_BYTES] + [x.tokens] * (x.cfg.parallel.tp > 1)
        return ids + residual_masks(x, 1)

    def final_norm_saved(self, x: Shapes) -> list[int]:
        return self.norm.saved(x, keeps_input=self.norm.keeps_input(x))


def formulas_of(arch: str) -> Formulas:
    """The closed forms of the registered architecture `arch`."""
    return load(architecture(arch).formulas)
