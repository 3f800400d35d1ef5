"""Sampling text from a checkpoint: greedy, temperature and top-k, in one process whatever
layout the checkpoint was trained with (its tensors are stored by global name)."""

from __future__ import annotations

from pathlib import Path

import torch

from megalite.checkpoint.sharded import (
    TOKENIZER,
    CheckpointError,
    load_parameters,
    read_manifest,
    resolve_checkpoint,
)
from megalite.config import build_config
from megalite.data import Tokenizer
from megalite.models import CausalLM, build_chunks
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom


def load_for_inference(path: Path, device: str = "cpu") -> tuple[CausalLM, Tokenizer]:
    """The whole model as one chunk (tp = pp = 1) with the weights of the checkpoint `path`
    names (a step directory, or a run's newest: see `resolve_checkpoint`), and its tokenizer."""
    path = resolve_checkpoint(Path(path))
    manifest = read_manifest(path)
    raw = manifest["trainer"]["config"]
    raw["parallel"] = {}  # one process: no tp/pp/sp
    raw["train"]["recompute"] = "none"
    cfg = build_config(raw)
    ps = ParallelState.single(device)
    # The checkpoint fills every weight: no random init to throw away.
    (model,) = build_chunks(cfg, ps, TPRandom(cfg.train.seed, ps), random_init=False)
    load_parameters(path, manifest, dict(model.named_parameters()), ps)
    if TOKENIZER not in manifest["files"]:
        raise CheckpointError(f"checkpoint {path} carries no tokenizer.model")
    return model.eval(), Tokenizer(path / TOKENIZER)


@torch.no_grad()
def generate(
    model: CausalLM,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ids (b, s) by max_new_tokens; temperature 0 means greedy. The context is the
    last max_positions tokens: all the positions the model has, even beyond its training
    seq_len."""
    context = model.ctx.cfg.max_positions
    for _ in range(max_new_tokens):
        logits = model(ids[:, -context:])[:, -1, :].float()  # (b, vocab)
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        ids = torch.cat([ids, next_id], dim=1)
    return ids


def sample_text(
    path: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int
) -> str:
    model, tokenizer = load_for_inference(path)
    ids = torch.tensor([tokenizer.encode(prompt) or [tokenizer.bos_id]])
    generator = torch.Generator().manual_seed(seed)
    out = generate(model, ids, max_new_tokens, temperature, top_k, generator)
    return tokenizer.decode(out[0].tolist())
