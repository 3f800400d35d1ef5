"""Single-process training throughput: megalite against Hugging Face transformers.

For each architecture (GPT-2 style and Llama style) this builds megalite's model and the
matching Hugging Face model (`GPT2LMHeadModel` / `LlamaForCausalLM`, from a config, offline)
of the same dimensions, and trains both in this process, fp32 on CPU, on the same batches with
the same optimizer: AdamW (same lr, betas, eps, weight decay on matrices only), global-norm
clipping at 1.0, a constant learning rate. Steps of the two are interleaved (and which goes
first alternates) so that the noise of a shared machine hits both alike; the table reports
medians over the steps after warm-up.

    .venv/bin/python tools/bench_single.py                    # both architectures
    .venv/bin/python tools/bench_single.py --arch llama --kv-heads 2 --threads 2

The batches are drawn from a fixed Zipf-like unigram distribution (seeded), so the loss has
something to learn within a few steps and a reader can see both implementations train. They
start from different initial weights, so their losses differ slightly.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megalite.checkpoint.hf import hf_config
from megalite.config import Config, load_config
from megalite.parallel_state import ParallelState
from megalite.training.setup import build_run
from megalite.training.step import train_step


@dataclass
class Contender:
    """One implementation of one model, ready to train a step on a (batch, seq + 1) batch."""

    model: str
    implementation: str
    params: int
    step: Callable[[torch.Tensor], float]
    """Runs one full training step (forward, backward, clip, AdamW) and returns the loss."""
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("gpt", "llama", "both"), default="both")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="llama only (default: heads)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--hf-adamw",
        choices=("default", "foreach", "fused"),
        default="default",
        help="torch.optim.AdamW implementation for the HF models (default: torch's choice)",
    )
    return parser.parse_args(argv)


def megalite_config(args: argparse.Namespace, arch: str) -> Config:
    overrides = [
        f"model.arch={arch}",
        f"model.n_layers={args.layers}",
        f"model.hidden={args.hidden}",
        f"model.n_heads={args.heads}",
        f"model.vocab_size={args.vocab}",
        f"model.seq_len={args.seq}",
        "model.dropout=0.0",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        "train.precision=fp32",
        "train.device=cpu",
        f"train.seed={args.seed}",
        f"optim.lr={args.lr}",
        "optim.warmup_steps=0",
        "optim.grad_clip=1.0",
    ]
    if arch == "llama" and args.kv_heads is not None:
        overrides.append(f"model.n_kv_heads={args.kv_heads}")
    return load_config(None, overrides)


def build_megalite(cfg: Config, label: str, lr: float) -> Contender:
    run = build_run(cfg, ParallelState.single("cpu"), num_microbatches=1)
    params = sum(p.numel() for p in run.named_parameters().values())

    def step(tokens: torch.Tensor) -> float:
        return train_step(run, tokens, lr).loss

    return Contender(label, "megalite", params, step)


def hf_model(cfg: Config) -> torch.nn.Module:
    """The Hugging Face model with megalite's dimensions (the config `megalite export-hf`
    writes), SDPA attention, no dropout."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg.model)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.train()


def build_hf(cfg: Config, label: str, lr: float, adamw: str) -> Contender:
    torch.manual_seed(cfg.train.seed)
    model = hf_model(cfg)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]  # megalite: matrices only
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[adamw]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, **impl)
    params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    vocab = cfg.model.vocab_size

    def step(tokens: torch.Tensor) -> float:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs, use_cache=False).logits  # (b, s, vocab)
        loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        return loss.item()

    return Contender(label, "transformers", params, step)


def make_batches(args: argparse.Namespace, count: int) -> list[torch.Tensor]:
    """`count` batches of (batch, seq + 1) token ids from a fixed Zipf-like distribution."""
    generator = torch.Generator().manual_seed(args.seed)
    weights = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64)
    weights = weights[torch.randperm(args.vocab, generator=generator)]
    shape = (args.batch, args.seq + 1)
    return [
        torch.multinomial(weights, shape[0] * shape[1], True, generator=generator).view(shape)
        for _ in range(count)
    ]


def measure(contenders: list[Contender], batches: list[torch.Tensor], warmup: int) -> None:
    """Interleave the contenders step by step, alternating who goes first; time each step."""
    for i, tokens in enumerate(batches):
        order = contenders if i % 2 == 0 else contenders[::-1]
        for contender in order:
            start = time.perf_counter()
            loss = contender.step(tokens)
            elapsed = time.perf_counter() - start
            contender.losses.append(loss)
            if i >= warmup:
                contender.times.append(elapsed)


def print_table(
    rows: list[Contender], tokens_per_step: int, round_to: int, args: argparse.Namespace
) -> None:
    header = (
        f"{'model':<7} {'implementation':<14} {'params':>11} {'tokens/s':>10} {'step ms':>9} "
        f"{'min ms':>8} {'ratio':>7} {'paired':>7} {'loss first -> last':>20}"
    )
    print(header)
    print("-" * len(header))
    reference = {r.model: r for r in rows if r.implementation == "transformers"}
    for r in rows:
        step_s = statistics.median(r.times)
        ratio = paired = "ref"
        if r.implementation == "megalite" and r.model in reference:
            hf_times = reference[r.model].times
            ratio = f"{statistics.median(hf_times) / step_s:.2f}x"
            paired = f"{statistics.median(h / m for h, m in zip(hf_times, r.times)):.2f}x"
        losses = f"{r.losses[0]:.3f} -> {r.losses[-1]:.3f}"
        rate = tokens_per_step / step_s
        print(
            f"{r.model:<7} {r.implementation:<14} {r.params:>11,} {rate:>10,.0f} "
            f"{step_s * 1e3:>9.1f} {min(r.times) * 1e3:>8.1f} {ratio:>7} {paired:>7} {losses:>20}"
        )
    print()
    print(
        f"fp32 CPU, {torch.get_num_threads()} threads; batch {args.batch} x seq {args.seq} = "
        f"{tokens_per_step} tokens/step; tokens/s and step ms are medians over {args.steps} steps "
        f"after {args.warmup} warm-up steps (min ms: fastest step); contenders interleaved."
    )
    print(
        "ratio = megalite tokens/s / transformers tokens/s (>= 1.00x: megalite at least as fast);"
        " paired = median over steps of the same ratio\nfor the two back-to-back steps on one "
        "batch (robust to load that drifts during the run on a shared machine)."
    )
    print(
        f"megalite pads the vocabulary to a multiple of {round_to} rows "
        f"({args.vocab} -> {padded(args.vocab, round_to)}; the padded rows' logits are never "
        "computed), so its params include the extra rows."
    )
    print(
        "transformers: attn_implementation='sdpa' (its fastest CPU path), dropout 0, train mode, "
        f"torch.optim.AdamW ({args.hf_adamw}); loss = F.cross_entropy, the mean over all tokens "
        "(megalite: the same mean, from its LM head fused with the loss)."
    )


def padded(vocab: int, multiple: int) -> int:
    return (vocab + multiple - 1) // multiple * multiple


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    archs = ["gpt", "llama"] if args.arch == "both" else [args.arch]
    batches = make_batches(args, args.warmup + args.steps)
    rows: list[Contender] = []
    for arch in archs:
        cfg = megalite_config(args, arch)
        label = {"gpt": "GPT-2", "llama": "Llama"}[arch]
        pair = [build_megalite(cfg, label, args.lr), build_hf(cfg, label, args.lr, args.hf_adamw)]
        measure(pair, batches, args.warmup)
        rows.extend(pair)
    print_table(rows, args.batch * args.seq, cfg.model.vocab_round_to, args)


if __name__ == "__main__":
    main()
