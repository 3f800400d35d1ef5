"""What a model chunk keeps for backward, tensor by tensor, in closed form.

The architecture says what its embedding and each of its blocks keep (`models.formulas`, where
the shared blocks' saved tensors are listed); this module adds what is the same for every
architecture:

- full recompute keeps each recomputed layer's input only; the layer being recomputed in
  backward briefly holds one layer's worth again (the working set);
- the fused LM head + loss keeps the gradient of its input and of its weight (so the weight
  gradient is held once per micro-batch in flight), in forward works on a chunk of fp32 logits
  at a time (`tensor_parallel.cross_entropy.chunk_tokens`), and in backward scales both kept
  gradients into new tensors;
- attention over a chunk layout (context parallelism, document masks) allocates, while a
  layer's attention runs, the K/V blocks it computes against and passes on and the fp32
  accumulators of its output or of dQ and dK/dV (`attention_working_sets`).
"""

from __future__ import annotations

from megalite.config import Config
from megalite.models.formulas import Shapes, formulas_of, qkv_features
from megalite.tensor_parallel.cross_entropy import CHUNK_LOGIT_BYTES, MIN_CHUNK_TOKENS
from megalite.tensor_parallel.layers import padded_vocab_size


def layer_body(x: Shapes) -> list[int]:
    """Tensors one layer keeps for backward, without its input (counted by the caller, since
    whether it is held depends on what comes before: a pipeline receive, a recompute)."""
    return formulas_of(x.cfg.model.arch).layer_saved(x)


def norm_keeps_input(x: Shapes) -> bool:
    """Whether a layer's first norm keeps the layer's input among its saved tensors."""
    return formulas_of(x.cfg.model.arch).layer_keeps_input(x)


def embedding_kept(x: Shapes) -> list[int]:
    """The embedding's saved tensors (token ids, positions, dropout mask)."""
    return formulas_of(x.cfg.model.arch).embedding_saved(x)


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
    final_norm = formulas_of(x.cfg.model.arch).final_norm_saved(x)
    return final_norm + [x.tokens * x.cfg.model.hidden * x.element]


def logits_working_set(x: Shapes) -> int:
    """What the fused head + loss allocates while its forward runs, beyond what it keeps: one
    chunk of logits, and with 16-bit weights the fp32 weight-gradient accumulator and one
    chunk's 16-bit weight-gradient product. The PyTorch softmax (cpu) works on an fp32 copy of
    16-bit logits; the Triton one (cuda) on the logits themselves, with four fp32 values per
    token (row max, sum, target logit, global max)."""
    rows, h, e = head_rows(x.cfg), x.cfg.model.hidden, x.element
    budget = CHUNK_LOGIT_BYTES[x.device]
    chunk = min(x.tokens, max(MIN_CHUNK_TOKENS, budget // (4 * rows)))
    working = chunk * rows * e
    if x.device == "cuda":
        working += 4 * chunk * 4
    elif e != 4:
        working += chunk * rows * 4
    if e != 4:
        working += rows * h * 4 + rows * h * e
    return working


def head_backward_working_set(x: Shapes) -> int:
    """What the head's backward allocates while its kept gradients are still alive: both scaled
    by the incoming gradient (the weight's becomes the parameter's .grad until it is added into
    the fp32 main gradient)."""
    return (
        head_rows(x.cfg) * x.cfg.model.hidden * x.element
        + x.tokens * x.cfg.model.hidden * x.element
    )


def attention_working_sets(x: Shapes) -> tuple[tuple[str, int], tuple[str, int]]:
    """(name, bytes) of what one layer's block attention (`context_parallel.attention`)
    allocates beyond what it keeps, in its forward and in its backward; 0 bytes for the flash
    kernel (its own working memory is not counted, as no kernel's is). With b s_l the local
    tokens and a K/V block the stacked (2, b, s_l, local kv heads, head_dim) in the compute
    dtype:

    - ring (`parallel.cp_comm=p2p`): forward holds the block it computes against and the one it
      receives meanwhile (one at cp 1: no ring), and under 16-bit precision the fp32 output
      accumulator (in fp32 it becomes the kept output); backward the same two K/V blocks and
      three fp32 dK/dV blocks (the one being summed, the previous one still being sent on, the
      one received from the previous rank; one at cp 1), the fp32 dQ accumulator and the fp32
      per-row delta;
    - all-gather: forward the local block, the gathered blocks and the whole window
      reassembled from them (2 x the whole window's K/V), plus the fp32 output accumulator
      under 16-bit precision; backward gathers again, and adds the whole window's fp32 dK/dV,
      its copy cut back into holders' pieces, this rank's reduced piece, dQ and delta in fp32.
    """
    if not x.chunked:
        return ("", 0), ("", 0)
    m, b, cp, e = x.cfg.model, x.cfg.train.micro_batch_size, x.cfg.parallel.cp, x.element
    kv_block = 2 * x.tokens * x.local_kv_heads * m.head_dim * e
    grad_block = kv_block // e * 4
    fp32_rows = x.tokens * x.local_heads * m.head_dim * 4  # the output or dQ accumulator
    out_accumulator = fp32_rows if e != 4 else 0
    delta = b * x.local_heads * x.seq * 4
    if cp > 1 and x.cfg.parallel.cp_comm == "allgather":
        gathered = kv_block + 2 * cp * kv_block  # local stack, gathered pieces, whole window
        backward = gathered + 2 * cp * grad_block + grad_block + fp32_rows + delta
        name = "all-gathered K/V"
        return (name, gathered + out_accumulator), (name, backward)
    name = "ring attention buffers" if cp > 1 else "block attention buffers"
    blocks = 2 if cp > 1 else 1
    forward = blocks * kv_block + out_accumulator
    backward = blocks * kv_block + (3 if cp > 1 else 1) * grad_block + fp32_rows + delta
    return (name, forward), (name, backward)


def deferred_weight_inputs(x: Shapes) -> list[int]:
    """What one layer's tensor-parallel linears hold from a split backward's B until its W
    (zero-bubble schedules, `tensor_parallel.deferred`): each linear's input x and the gradient
    of its output dy, as the linear was given them (a column-parallel x and a row-parallel dy
    are sequence shards under SP); for q/k/v and the out projection, then the MLP's linears
    (the architecture's `mlp_deferred_inputs`: none for experts). Under `train.fp8=tensorwise`
    each x is its float8 copy."""
    m, tokens, e = x.cfg.model, x.tokens, x.element
    stream = x.stream_tokens * m.hidden * e
    qkv = tokens * (x.local_heads + 2 * x.local_kv_heads) * m.head_dim * e
    attention_out = tokens * x.local_heads * m.head_dim * e
    mlp = formulas_of(m.arch).mlp_deferred_inputs(x)
    qkv_x = x.kept_input(stream, m.hidden, qkv_features(m))
    out_x = x.kept_input(attention_out, m.q_width, m.hidden)
    return [qkv_x, qkv, out_x, stream, *mlp]
