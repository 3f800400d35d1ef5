"""Training throughput on one GPU: megalite, eager and compiled, against Hugging Face
transformers under torch.compile, in one process.

For each config of `--configs` (by default GPT-2 124M: 12 layers, width 768, 12 heads, vocab
50257, seq 1024, micro-batch 16; and gpt2-1.3b: 24 layers, width 2048, 16 heads, seq 2048,
micro-batch 8) three contenders train the model's dimensions on one device, one micro-batch per
step, on the same batches:

- megalite: the model as `megalite train` builds it (tp = pp = 1, no recompute): bf16 weights,
  fp32 main gradients and master weights, its fused kernels, torch's fused AdamW;
- megalite compile: the same with `train.compile=true`;
- transformers compile: `GPT2LMHeadModel` of the same dimensions, built offline from a config
  (`attn_implementation="sdpa"`), fp32 weights under bf16 autocast (mixed precision as
  `torch.autocast` does it, not bf16 weights), its forward and loss in `torch.compile`,
  torch's fused AdamW.

Both sides: AdamW with megalite's hyper-parameters (the config's lr, constant; betas 0.9/0.95,
eps 1e-8, weight decay 0.1 on matrices only), global-norm clipping at 1.0, the mean token loss.
Each contender runs under the same conditions, alone: it is built, trained in a plain loop over
the same batches (warm-up steps, then timed steps, each ending with `torch.cuda.synchronize`),
and freed, with the allocator's cache, before the next one is built. So every
step has the GPU to itself, nothing moves between steps, the peak memory read around a
contender's steps is its own, and the device needs to hold one contender only (three 1.3B
ones do not fit in an H100 together).

    python tools/bench_gpu.py                                  # both models, needs CUDA
    python tools/bench_gpu.py --configs configs/gpt2-1.3b.yaml --micro-batch 4 --steps 20
    python tools/bench_gpu.py --device cpu --layers 2 --hidden 64 --heads 2 --seq 32 \\
        --vocab 512 --micro-batch 2                            # tiny, fp32 on CPU: that it runs
    python -m megalite.benchmarks.gpu                          # from an installed megalite

FLOPs are megalite's count (`models.flops.flops_per_token`, causal attention halved) for both
sides, and MFU divides by the device's dense peak for the precision (H100 SXM bf16: 989
TFLOP/s; on CPU the machine's measured fp32 peak).
"""

from __future__ import annotations

import argparse
import functools
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megalite.benchmarks import harness, single
from megalite.benchmarks.table import print_table, time_ratio
from megalite.benchmarks.torch_gpt import torch_adamw
from megalite.config import Config, load_config
from megalite.hardware import peak_flops
from megalite.models.flops import flops_per_token
from megalite.parallel_state import ParallelState

CONFIGS = ["configs/gpt2-124m.yaml", "configs/gpt2-1.3b.yaml"]
REFERENCE = "transformers compile"


def options() -> argparse.ArgumentParser:
    """This benchmark's command line: the configs, and sizes that override theirs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=CONFIGS, help="the models, one per config")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--micro-batch", type=int, help="samples per step (default: the config's)")
    for name in ("layers", "hidden", "heads", "seq", "vocab"):
        p.add_argument(f"--{name}", type=int, help="override the config's")
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--seed", type=int, default=1234)
    return p


def model_args(args: argparse.Namespace, path: str) -> argparse.Namespace:
    """One model's dimensions, micro-batch and lr, as `harness` reads them: the config's, less
    what the command line overrides."""
    cfg = load_config(path)
    m = cfg.model
    return argparse.Namespace(
        name=Path(path).stem,
        layers=args.layers or m.n_layers,
        hidden=args.hidden or m.hidden,
        heads=args.heads or m.n_heads,
        seq=args.seq or m.seq_len,
        vocab=args.vocab or m.vocab_size,
        micro_batch=args.micro_batch or cfg.train.micro_batch_size,
        lr=cfg.optim.lr,
        seed=args.seed,
    )


def benchmark_config(model: argparse.Namespace, device: torch.device, *overrides: str) -> Config:
    """megalite's config of the model on `device`: bf16 on a GPU, fp32 on CPU."""
    precision = "bf16" if device.type == "cuda" else "fp32"
    mb = model.micro_batch
    return harness.megalite_config(
        model, mb, mb, f"train.precision={precision}", f"train.device={device.type}", *overrides
    )


def synchronize(device: torch.device) -> None:
    """Wait for all the device's work (every stream): a GPU runs behind the host that times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronized(
    step: Callable[[torch.Tensor], dict[str, float]], device: torch.device
) -> Callable[[torch.Tensor], dict[str, float]]:
    """`step`, returning once the device has done its work (the harness times the host)."""

    def run(tokens: torch.Tensor) -> dict[str, float]:
        result = step(tokens)
        synchronize(device)
        return result

    return run


def megalite_contender(
    model: argparse.Namespace, device: torch.device, compile: bool
) -> harness.Contender:
    """megalite's training step on `device`, eager or with train.compile."""
    cfg = benchmark_config(model, device, f"train.compile={str(compile).lower()}")
    run = harness.megalite_run(cfg, ParallelState.single(device))
    params = sum(p.numel() for p in run.named_parameters().values())
    step = synchronized(harness.megalite_step(run, model.lr), device)
    name = "megalite compile" if compile else "megalite"
    return harness.Contender(name, step, REFERENCE, info={"params": params})


def hf_contender(model: argparse.Namespace, device: torch.device) -> harness.Contender:
    """transformers' GPT-2 of the same dimensions, compiled, with torch's fused AdamW."""
    cfg = benchmark_config(model, device)
    torch.manual_seed(cfg.train.seed)
    hf = single.hf_model(cfg).to(device)
    optimizer = torch_adamw(hf.parameters(), model.lr, "fused")
    params = sum(p.numel() for p in hf.parameters())  # tied weights are counted once
    step = synchronized(single.hf_step(hf, optimizer, cfg, compile=True), device)
    return harness.Contender(REFERENCE, step, info={"params": params})


def free(device: torch.device) -> None:
    """Release what a finished contender left behind: its objects (autograd and closures hold
    reference cycles) and, on a GPU, the allocator's cached blocks, so that the next contender
    starts on an empty device with an empty cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_alone(
    build: Callable[[], harness.Contender],
    batches: list[torch.Tensor],
    warmup: int,
    device: torch.device,
    tokens_per_step: int,
) -> dict[str, Any]:
    """The row of the contender `build` makes, trained in a plain loop over `batches` (the
    first `warmup` untimed), then freed: `harness.summary`'s, with its `losses`, `compile_s`
    (its first step's time less the median) and on a GPU `peak_bytes` (the most allocated
    during its steps, its own state included)."""
    contender = build()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    harness.measure([contender], batches, warmup)
    [row] = harness.summary([contender], tokens_per_step)
    first = contender.warmup_times[:1]
    row.update(losses=contender.losses, compile_s=first[0] - row["step_s"] if first else None)
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    del contender  # its step held the model, its gradients and optimizer state
    free(device)
    return row


def measure_model(args: argparse.Namespace, path: str, device: torch.device) -> list[dict]:
    """The three contenders on one config's model, one after another (`measure_alone`) on the
    same batches: one row each."""
    model = model_args(args, path)
    builds = [
        functools.partial(megalite_contender, model, device, compile=False),
        functools.partial(megalite_contender, model, device, compile=True),
        functools.partial(hf_contender, model, device),
    ]
    batches = harness.make_batches(model, args.warmup + args.steps, model.micro_batch)
    batches = [b.to(device) for b in batches]
    tokens = model.micro_batch * model.seq
    rows = [measure_alone(build, batches, args.warmup, device, tokens) for build in builds]
    cfg = benchmark_config(model, device)
    flops = flops_per_token(cfg.model)
    peak = peak_flops(device, cfg.train.precision)
    for row in rows:
        tflops = flops * row["tokens_s"] / 1e12
        row.update(model=model.name, tflops=tflops, mfu=tflops * 1e12 / peak if peak else None)
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    """Measure every config's model in this process; one row per (model, contender)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device here (--device cpu runs it on the CPU)")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return [row for path in args.configs for row in measure_model(args, path, device)]


COLUMNS = [
    "model",
    "implementation",
    "params",
    "tokens/s",
    "step ms",
    "TFLOP/s",
    "MFU",
    "compile s",
    "peak GiB",
    "ratio m/t",
    "loss first -> last",
]


def cells(row: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """One row of the table (`rows`: all of them, for the ratio to the same model's HF row)."""
    same_model = [r for r in rows if r["model"] == row["model"]]
    peak = row.get("peak_bytes")
    return [
        row["model"],
        row["name"],
        f"{row['params'] / 1e6:,.1f}M",
        f"{row['tokens_s']:,.0f}",
        f"{row['step_s'] * 1e3:.1f}",
        f"{row['tflops']:.2f}",
        "-" if row["mfu"] is None else f"{row['mfu']:.1%}",
        "-" if row["compile_s"] is None else f"{row['compile_s']:.1f}",
        "-" if peak is None else f"{peak / 2**30:.2f}",
        time_ratio(row, same_model),
        f"{row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}",
    ]


def notes(args: argparse.Namespace) -> list[str]:
    """How the table was measured and how to read it."""
    precision = "bf16" if args.device == "cuda" else "fp32"
    return [
        f"{args.device}, {precision}; one micro-batch per step; tokens/s and step ms: medians of "
        f"{args.steps} steps after {args.warmup} warm-up steps, each contender alone in a plain "
        "loop over the same batches.",
        "TFLOP/s: megalite's model FLOPs (6 per weight per token plus causal attention, no "
        "recompute) for every row; MFU: over the device's dense peak for the precision.",
        "compile s: the first step's time minus the median step's (eager rows: the first "
        "step's allocations and kernel selection).",
        "peak GiB: torch.cuda.max_memory_allocated during the contender's steps, alone on the "
        "device (the one before it freed).",
        "ratio m/t = step time / transformers compile's (<= 1.00: no slower). transformers: "
        "fp32 weights under bf16 autocast on a GPU, vocabulary unpadded; megalite pads it to "
        "a multiple of 128 rows (padded rows' logits are masked out of the loss).",
    ]


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    """Print the table of `run`'s rows."""
    print_table(COLUMNS, [cells(row, rows) for row in rows], notes(args))


def main(argv: list[str] | None = None) -> None:
    harness.command_line(options(), run, report, argv)


if __name__ == "__main__":
    main()
