"""Benchmark the pieces of a mixture-of-experts layer, and print a table.

Grouped GEMM: `grouped_mm` (the Triton kernel on a GPU; on CPU its dispatch runs the torch path,
`torch._grouped_mm`) against the per-expert loop, `grouped_mm_reference` (one GEMM per expert over
``x.split(counts.tolist())``). Rows are tokens x top-k, sorted by expert and spread over E
experts, balanced (equal counts) or skewed (counts proportional to 1 / (rank + 1), the first
expert busiest); for each, the expert MLP's two GEMM shapes, up (hidden -> ffn) and down (ffn ->
hidden). Forward and forward+backward (dx and dweight) ms and TFLOP/s: 2*rows*in*out forward,
three times that with backward.

Training step at ep 1 / 2 / 4: `configs/mixtral-tiny.yaml` (8 experts, top-2) trained for a
few steps on `--ranks` gloo processes (dp = ranks, ep carved out of dp), the same global batch
each time: median tokens/s and step time over the steps after the first, and the loss of the
last step (equal across ep: every layout computes the same model).

    python tools/bench_moe.py                # a GPU: the kernel; CPU: torch's, modest sizes
    python tools/bench_moe.py --cpu-smoke    # tiny sizes under the Triton interpreter:
                                             # checks that it runs, the times mean nothing
    python -m megalite.benchmarks.moe        # the same, from an installed megalite

megalite.kernels is imported only inside the functions: `--cpu-smoke` sets TRITON_INTERPRET
before the first import of triton.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch  # does not import triton, so TRITON_INTERPRET can still be set below

from megalite.benchmarks.table import print_table

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SIZES = {  # defaults per run: on a GPU, on a CPU (the reference), and --cpu-smoke
    "cuda": {"tokens": 16384, "top_k": 2, "hidden": 4096, "ffn": 4096, "experts": [8, 64],
             "dtype": "bf16"},
    "cpu": {"tokens": 1024, "top_k": 2, "hidden": 256, "ffn": 512, "experts": [8, 32],
            "dtype": "fp32", "repeats": 5},
    "smoke": {"tokens": 24, "top_k": 2, "hidden": 40, "ffn": 72, "experts": [4],
              "dtype": "bf16", "repeats": 1},
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; sizes left unset take the defaults of the run (`SIZES`)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, help="tokens per step; rows = tokens x top-k")
    p.add_argument("--top-k", type=int, help="experts per token")
    p.add_argument("--hidden", type=int, help="model width")
    p.add_argument("--ffn", type=int, help="expert MLP hidden size")
    p.add_argument("--experts", type=int, nargs="+", help="expert counts, one group of rows each")
    p.add_argument("--dtype", choices=DTYPES)
    p.add_argument("--repeats", type=int, help="CPU: median of this many timed calls")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, Triton interpreter")
    p.add_argument("--ranks", type=int, default=4, help="gloo processes of the step table")
    p.add_argument("--eps", type=int, nargs="*", default=[1, 2, 4],
                   help="ep of each row of the step table (none: no step table)")  # fmt: skip
    p.add_argument("--steps", type=int, default=4, help="training steps per step row")
    p.add_argument("--step-overrides", nargs="*", default=[],
                   help="config overrides of the step table (model.n_layers=2 ...)")  # fmt: skip
    args = p.parse_args(argv)
    run = "smoke" if args.cpu_smoke else "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in SIZES[run].items():  # (a GPU times with do_bench: no --repeats)
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def expert_counts(rows: int, experts: int, skewed: bool) -> list[int]:
    """Rows per expert: equal, or proportional to 1 / (rank + 1); the remainder to expert 0."""
    weights = [1 / (rank + 1) if skewed else 1.0 for rank in range(experts)]
    counts = [int(rows * w / sum(weights)) for w in weights]
    counts[0] += rows - sum(counts)
    return counts


def time_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Milliseconds per call: triton.testing.do_bench on CUDA, else the median of `repeats`
    calls after one warm-up call (none when `repeats` is 1, as under the interpreter)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100)
    if repeats > 1:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def grouped_gemm_row(
    args: argparse.Namespace,
    experts: int,
    skewed: bool,
    features: tuple[str, int, int],
    device: torch.device,
) -> list[str]:
    """One table row: both contenders' forward and forward+backward ms and TFLOP/s."""
    from megalite.kernels.grouped_gemm import grouped_mm, grouped_mm_reference

    name, in_features, out_features = features
    dtype, rows = DTYPES[args.dtype], args.tokens * args.top_k
    counts = expert_counts(rows, experts, skewed)
    x = torch.randn(rows, in_features, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(experts, out_features, in_features, device=device, dtype=dtype)
    weight = (weight / in_features**0.5).requires_grad_()
    counts_t = torch.tensor(counts, device=device)
    dy = torch.randn(rows, out_features, device=device, dtype=dtype)
    flops = 2 * rows * in_features * out_features
    cells = []
    for fn in (grouped_mm, grouped_mm_reference):
        with torch.no_grad():
            fwd = time_ms(lambda f=fn: f(x, weight, counts_t), device, args.repeats)
        both = time_ms(
            lambda f=fn: torch.autograd.grad(f(x, weight, counts_t), (x, weight), dy),
            device,
            args.repeats,
        )
        cells.append((fwd, flops / fwd / 1e9, both, 3 * flops / both / 1e9))
    (gf, gft, gb, gbt), (lf, lft, lb, lbt) = cells
    kind = "skewed" if skewed else "balanced"
    return [
        f"E {experts} {kind} {name} ({in_features}->{out_features})",
        f"{min(counts)}-{max(counts)}",
        *(f"{ms:.2f}" for ms in (gf, lf)),
        *(f"{tf:.2f}" for tf in (gft, lft)),
        *(f"{ms:.2f}" for ms in (gb, lb)),
        *(f"{tf:.2f}" for tf in (gbt, lbt)),
    ]


def bench_grouped_gemm(args: argparse.Namespace, device: torch.device) -> None:
    """Print the grouped GEMM table: grouped against the per-expert loop, one row per expert
    count, balanced or skewed counts, and up or down projection."""
    from megalite.kernels import kernel_backend

    backend = kernel_backend(torch.zeros(1, device=device))
    grouped = "the Triton kernel" if backend == "triton" else "torch._grouped_mm"
    rows = args.tokens * args.top_k
    print(f"\ngrouped GEMM: {args.dtype}, {args.tokens} tokens x top-{args.top_k} = {rows} rows")
    print(f"over E experts; grouped_mm runs {grouped}")
    up, down = ("up", args.hidden, args.ffn), ("down", args.ffn, args.hidden)
    table = [
        grouped_gemm_row(args, experts, skewed, features, device)
        for experts in args.experts
        for skewed in (False, True)
        for features in (up, down)
    ]
    columns = ["experts, counts, GEMM (in->out)", "rows/expert"]
    for what in ("fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s"):
        columns += [f"{what} grouped", "loop"]
    timing = "triton.testing.do_bench" if device.type == "cuda" else f"median of {args.repeats}"
    notes = [
        "grouped: grouped_mm, one launch per product over all experts; loop: "
        "grouped_mm_reference, one GEMM per expert over x.split(counts.tolist()).",
        "skewed: counts proportional to 1 / (rank + 1). TFLOP/s counts 2*rows*in*out forward, "
        f"3x that forward+backward (dx, dweight); times: {timing}.",
    ]
    print_table(columns, table, notes)


def pick_device(args: argparse.Namespace) -> torch.device:
    """CUDA if present, measuring the Triton kernel; else the CPU: under the interpreter with
    --cpu-smoke, the PyTorch reference otherwise."""
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before megalite.kernels imports triton
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    # measure the kernel where it can run, never a silent fallback; the reference elsewhere
    from megalite.kernels import dispatch  # after TRITON_INTERPRET is settled

    dispatch.use("triton" if cuda or args.cpu_smoke else "torch")
    return torch.device("cuda" if cuda else "cpu")


def _train(overrides: list[str]) -> None:
    from megalite.config import load_config
    from megalite.training.loop import train

    train(load_config(STEP_CONFIG, overrides))


STEP_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "mixtral-tiny.yaml")


def bench_step(args: argparse.Namespace) -> None:
    """Print the training-step table: one row per ep, on `args.ranks` CPU processes (the
    PyTorch references: `MEGALITE_KERNELS=torch`, as `pick_device` set it)."""
    from megalite.launch import run_ranks

    rows = []
    for ep in args.eps:
        with tempfile.TemporaryDirectory(prefix="megalite-bench-moe-") as out:
            overrides = [
                *args.step_overrides,
                f"parallel.ep={ep}",
                f"train.steps={args.steps}",
                f"train.global_batch_size={8 * args.ranks}",
                "train.eval_interval=100000",
                "checkpoint.interval=0",
                "logging.progress=false",
                f"train.out_dir={out}",
            ]
            run_ranks(args.ranks, _train, overrides)
            metrics = [json.loads(line) for line in Path(out, "metrics.jsonl").open()]
        timed = metrics[1:] or metrics
        rows.append(
            [
                str(ep),
                str(args.ranks // ep),
                f"{statistics.median(m['tokens_per_sec'] for m in timed):,.0f}",
                f"{statistics.median(m['step_time_s'] for m in timed) * 1e3:.0f}",
                f"{metrics[-1]['loss']:.4f}",
            ]
        )
    changed = f" ({' '.join(args.step_overrides)})" if args.step_overrides else ""
    print(f"\ntraining step: mixtral-tiny{changed}, {args.ranks} ranks")
    notes = ["tokens/s and step ms: medians over the steps after the first, of every rank's."]
    print_table(["ep", "edp", "tokens/s", "step ms", "last loss"], rows, notes)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, pick the device, print the tables."""
    args = parse_args(argv)
    device = pick_device(args)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    interpreter = " (Triton interpreter)" if args.cpu_smoke else ""
    print(f"device: {name}{interpreter}, torch {torch.__version__}")
    bench_grouped_gemm(args, device)
    if device.type == "cpu" and not args.cpu_smoke and args.eps:  # gloo ranks: a CPU table
        bench_step(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
