"""What a model chunk keeps for backward, tensor by tensor, in closed form.

Korthikanti et al. (2022) count a GPT layer with 16-bit activations and 1-byte dropout masks;
megalite's layers differ in ways that matter once the estimate is held against measurement, so
this module lists the tensors autograd actually saves in `models/` (the counts the tests check
against `SavedActivationTracker`):

- norms: LayerNorm keeps its input and two statistics per token; RMSNorm keeps its input and
  an fp32 1/rms per token with the Triton kernel, and with PyTorch's reference (computed in
  fp32) an fp32 copy of its input (the input itself in fp32), 1/rms per token and the
  normalised tensor before the weight; its output feeds the linears. The MLP's norm adds the
  attention residual in the same call: the sum is the input it keeps;
- column-parallel linears keep their input, one tensor for all that read it (q, k, v), under
  SP the sequence shard (gathered again in backward, as Megatron does);
- attention: with dropout 0 a flash kernel (Triton on GPU, SDPA on CPU) keeps q, k, v (k and v
  with the local kv heads: n_kv/tp, or the one head a rank computes when n_kv < tp), its output
  and a per-row fp32 log-sum-exp; with dropout the math path keeps contiguous copies of q and of
  k, v repeated to every head, the scores' softmax, dropout mask and dropped probabilities
  (b * heads * s^2 each) and the s^2 causal mask; selective recompute keeps only q, k, v and
  the output;
- MLP: GPT keeps its input, the pre-GELU and post-GELU tensors (ffn/tp wide); Llama keeps its
  input, gate, up and the product (Triton's SwiGLU), plus silu(gate) with PyTorch's reference;
- dropout masks are 1 byte on CUDA and the activation dtype on CPU; LayerNorm statistics fp32
  on CUDA and the activation dtype on CPU;
- full recompute keeps each recomputed layer's input only; the layer being recomputed in
  backward briefly holds one layer's worth again (the working set);
- the fused LM head + loss keeps the gradient of its input and of its weight (so the weight
  gradient is held once per micro-batch in flight), in forward works on a chunk of fp32 logits
  at a time (`tensor_parallel.cross_entropy.chunk_tokens`), and in backward scales both kept
  gradients into new tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config import Config
from megalite.tensor_parallel.cross_entropy import CHUNK_LOGIT_BYTES, MIN_CHUNK_TOKENS
from megalite.tensor_parallel.layers import padded_vocab_size

INDEX_BYTES = 8
"""int64 token ids and positions."""


@dataclass(frozen=True)
class Shapes:
    """The sizes one rank's chunk works with, for one micro-batch."""

    cfg: Config
    element: int
    """Bytes per activation element (the training precision)."""
    device: str
    """"cuda" (Triton kernels, 1-byte dropout masks) or "cpu" (PyTorch references)."""

    @property
    def tokens(self) -> int:
        """Tokens of a micro-batch: what attention and the MLP see (the full sequence)."""
        return self.cfg.train.micro_batch_size * self.cfg.model.seq_len

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


def _norm(x: Shapes, keeps_input: bool) -> list[int]:
    """Tensors a norm keeps besides its output: its input when `keeps_input` (when it is not
    already counted as held elsewhere)."""
    tr, h, e = x.stream_tokens, x.cfg.model.hidden, x.element
    if x.cfg.model.arch == "gpt":
        stat = 4 if x.device == "cuda" else e
        return [tr * h * e] * keeps_input + [tr * stat] * 2
    if x.device == "cuda":  # Triton's RMSNorm
        return [tr * h * e] * keeps_input + [tr * 4]
    fp32_input = [tr * h * 4] if (keeps_input or e != 4) else []  # in fp32 the input itself
    return fp32_input + [tr * 4, tr * h * e]


def norm_keeps_input(x: Shapes) -> bool:
    """Whether a norm's saved tensors include its input (LayerNorm and Triton's RMSNorm always;
    PyTorch's RMSNorm in fp32, where its fp32 copy is the input)."""
    return x.cfg.model.arch == "gpt" or x.device == "cuda" or x.element == 4


def _attention(x: Shapes, selective: bool) -> list[int]:
    """Attention's saved tensors after its input (q, k, v onwards, its output included)."""
    m = x.cfg.model
    t, e, b = x.tokens, x.element, x.cfg.train.micro_batch_size
    q = t * x.local_heads * m.head_dim * e
    kv = t * x.local_kv_heads * m.head_dim * e
    if not x.dropout:  # flash kernel
        return [q, kv, kv, q, b * x.local_heads * m.seq_len * 4]
    if selective:  # recompute keeps the inputs of the core attention
        return [q, kv, kv, q]
    probs = b * x.local_heads * m.seq_len**2
    return [q, q, q, q, probs * e, probs * x.mask, probs * e, m.seq_len**2]


def _mlp(x: Shapes) -> list[int]:
    """The MLP's saved tensors after its input."""
    wide = x.tokens * (x.cfg.model.ffn_hidden // x.cfg.parallel.tp) * x.element
    if x.cfg.model.arch == "gpt":
        return [wide, wide]
    return [wide] * (3 if x.device == "cuda" else 4)


def layer_body(x: Shapes) -> list[int]:
    """Tensors one layer keeps for backward, without its input (counted by the caller, since
    whether it is held depends on what comes before: a pipeline receive, a recompute)."""
    h, e = x.cfg.model.hidden, x.element
    residual_mask = [x.stream_tokens * h * x.mask] if x.dropout else []
    middle = [x.stream_tokens * h * e] if norm_keeps_input(x) else []
    selective = x.cfg.train.recompute == "selective"
    return (
        _norm(x, keeps_input=False)
        + _linear_input(x)  # q, k, v
        + _attention(x, selective)
        + residual_mask
        + middle
        + _norm(x, keeps_input=False)
        + _linear_input(x)  # fc; or gate and up
        + _mlp(x)
        + residual_mask
    )


def _linear_input(x: Shapes) -> list[int]:
    """The input that column-parallel linears keep: (b, s, h), or the shard (b, s/tp, h) under
    SP."""
    return [x.stream_tokens * x.cfg.model.hidden * x.element]


def embedding_kept(x: Shapes) -> list[int]:
    """The embedding's saved tensors: token ids (shifted to the rank's vocabulary piece, with a
    mask of the ids outside it, under tp), GPT's position ids, and its dropout mask."""
    p, m, b = x.cfg.parallel, x.cfg.model, x.cfg.train.micro_batch_size
    ids = [b * m.seq_len * INDEX_BYTES]
    if p.tp > 1:
        ids.append(b * m.seq_len)
    if m.arch == "gpt":  # positions: a slice (the rank's shard under SP) of one arange
        ids.append(m.seq_len * INDEX_BYTES)
    mask = [x.stream_tokens * m.hidden * x.mask] if x.dropout else []
    return ids + mask


def head_rows(cfg: Config) -> int:
    """Rows of the LM head weight on one tp rank (the padded vocabulary's share)."""
    m, tp = cfg.model, cfg.parallel.tp
    return padded_vocab_size(m.vocab_size, tp, m.vocab_round_to) // tp


def head_weight_grad(x: Shapes) -> int:
    """The head's weight gradient the fused loss keeps until backward (fp32 under fp16)."""
    kept = 4 if x.cfg.train.precision == "fp16" else x.element
    return head_rows(x.cfg) * x.cfg.model.hidden * kept


def head_kept(x: Shapes) -> list[int]:
    """The final norm's saved tensors and the head's input gradient (its weight gradient is
    `head_weight_grad`)."""
    return _norm(x, keeps_input=norm_keeps_input(x)) + [x.tokens * x.cfg.model.hidden * x.element]


def logits_working_set(x: Shapes) -> int:
    """What the fused head + loss allocates while its forward runs, beyond what it keeps: one
    chunk of fp32 logits, and with 16-bit weights their 16-bit copy, the fp32 weight-gradient
    accumulator and one chunk's 16-bit weight-gradient product."""
    rows, h, e = head_rows(x.cfg), x.cfg.model.hidden, x.element
    budget = CHUNK_LOGIT_BYTES[x.device]
    chunk = min(x.tokens, max(MIN_CHUNK_TOKENS, budget // (4 * rows)))
    working = chunk * rows * 4
    if e != 4:
        working += chunk * rows * e + rows * h * 4 + rows * h * e
    return working


def head_backward_working_set(x: Shapes) -> int:
    """What the head's backward allocates while its kept gradients are still alive: both scaled
    by the incoming gradient (the weight's becomes the parameter's .grad until it is added into
    the fp32 main gradient)."""
    return (
        head_rows(x.cfg) * x.cfg.model.hidden * x.element
        + x.tokens * x.cfg.model.hidden * x.element
    )


def deferred_weight_inputs(x: Shapes) -> list[int]:
    """What one layer's linears hold from a split backward's B until its W (zero-bubble
    schedules, `tensor_parallel.deferred`): each linear's input x and the gradient of its
    output dy, as the linear was given them (a column-parallel x and a row-parallel dy are
    sequence shards under SP); for q/k/v, the out projection, fc (or gate and up) and the down
    projection."""
    m, tokens, e = x.cfg.model, x.tokens, x.element
    wide = x.tokens * (m.ffn_hidden // x.cfg.parallel.tp) * e
    stream = x.stream_tokens * m.hidden * e
    qkv = tokens * (x.local_heads + 2 * x.local_kv_heads) * m.head_dim * e
    attention_out = tokens * x.local_heads * m.head_dim * e
    up = wide if m.arch == "gpt" else 2 * wide
    return [stream, qkv, attention_out, stream, stream, up, wide, stream]
