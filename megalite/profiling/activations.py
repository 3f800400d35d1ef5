"""What a model chunk keeps for backward, tensor by tensor, in closed form.

The architecture says what its embedding and each of its blocks keep (`models.formulas`, where
the shared blocks' saved tensors are listed); this module adds what is the same for every
architecture:

- full recompute keeps each recomputed layer's input only; the layer being recomputed in
  backward briefly holds one layer's worth again (the working set);
- the fused LM head + loss keeps the gradient of its input and of its weight (so the weight
  gradient is held once per micro-batch in flight), in forward works on a chunk of fp32 logits
  at a time (`tensor_parallel.cross_entropy.chunk_tokens`), and in backward scales both kept
  gradients into new tensors.
"""

from __future__ import annotations

from megalite.config import Config
from megalite.models.formulas import Shapes, formulas_of
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
