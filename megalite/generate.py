"""Sampling text from a checkpoint: greedy, temperature and top-k, in one process whatever
layout the checkpoint was trained with (its tensors are stored by global name)."""

from __future__ import annotations

from pathlib import Path

import torch

from megalite.checkpoint.sharded import Checkpoint, resolve_checkpoint
from megalite.models.causal_lm import CausalLM


@torch.no_grad()
def generate(
    model: CausalLM,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ids (b, s) by max_new_tokens; temperature 0 means greedy; `top_k` None or 0
    samples from the whole vocabulary (transformers' convention). The context is the last
    max_positions tokens: all the positions the model has, even beyond its training seq_len."""
    if not temperature >= 0:  # a negative one would sample the least likely tokens
        raise ValueError(f"temperature must be 0 (greedy) or more, not {temperature}")
    context = model.ctx.cfg.max_positions
    for _ in range(max_new_tokens):
        logits = model(ids[:, -context:])[:, -1, :].float()  # (b, vocab)
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        ids = torch.cat([ids, next_id], dim=1)
    return ids


def sample_text(
    path: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int
) -> str:
    checkpoint = Checkpoint(resolve_checkpoint(Path(path)))
    model, tokenizer = checkpoint.model(), checkpoint.tokenizer
    # no prompt: start where every training document starts, after a document's end (the
    # prepared data separates documents by EOS alone; BOS never appears in it)
    ids = torch.tensor([tokenizer.encode(prompt) or [tokenizer.eos_id]])
    generator = torch.Generator().manual_seed(seed)
    out = generate(model, ids, max_new_tokens, temperature, top_k, generator)
    return tokenizer.decode(out[0].tolist())
