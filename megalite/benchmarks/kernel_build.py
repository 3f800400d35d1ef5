"""What each Triton kernel would need on a GPU, read on any machine, with or without one.

Every candidate tile of every kernel megalite launches for a model (its attention variants,
norms, activations, rotary, cross-entropy, grouped GEMM and weight-gradient GEMM, forward and
backward) is compiled for a GPU target by Triton's own compiler and ptxas
(`megalite.kernels.gpu_build` says how). The table gives, per candidate: the shared memory it
needs against the target's, the registers per thread, the bytes spilled to local memory, and
the compile seconds. A launch many configs share is compiled once, in the row of the first.

Each config is built at the sizes one rank sees in its own layout (`parallel.tp` splits the
heads, the FFN and the vocabulary; `parallel.ep` the experts) and on a single GPU (tp 1, ep 1).
Most of a split only changes sizes the kernels take at run time, but Triton compiles a kernel
of its own for a size of 1 (one K/V head or one expert a rank) and for one that is no longer a
multiple of 16 (gpt2-1.3b's 8 heads a rank at tp 2).

    python tools/build_kernels.py                        # the shipped configs, bf16, sm90
    python tools/build_kernels.py --targets sm90 sm80 sm89 sm100 --dtypes bf16 fp16
    python tools/build_kernels.py --configs configs/llama-7b.yaml --calls attention

Exit status 1 when something would fail on a target: a candidate that does not compile, or a
launch none of whose candidates fits the target's shared memory (the lines below the table).
Compile seconds are a first run's: Triton's cache is a new, empty directory. A GPU's first
training step pays them on its host CPU before it times the candidates.

megalite.kernels is imported only inside `main`, after MEGALITE_TRITON_BUILD_ONLY is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megalite.benchmarks.table import print_table
from megalite.errors import ConfigError, MegaliteError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHIPPED = sorted(str(p) for p in (Path(__file__).parents[2] / "configs").glob("*.yaml"))
"""The default configs: every shipped one (launches of the same shapes are built once)."""
LAYOUTS = ("single", "own")
"""A single GPU's sizes first: a compile both ask for is shown in the single GPU's row."""


def parse_args(argv: list[str] | None, targets: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=SHIPPED, help="model configs (YAML)")
    parser.add_argument("--targets", nargs="+", default=["sm90"], choices=targets)
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument(
        "--calls", nargs="+", default=None, help="only these kernel calls (default: all)"
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=list(LAYOUTS),
        choices=list(LAYOUTS),
        help="single: one GPU; own: one rank of the config's tp x ep layout (default: both)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="compiles at once (threads: Triton's compiler and ptxas release the GIL)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    os.environ["MEGALITE_TRITON_BUILD_ONLY"] = "1"
    os.environ.pop("TRITON_INTERPRET", None)
    from megalite.kernels import gpu_build

    args = parse_args(argv, list(gpu_build.TARGETS))
    targets = [gpu_build.TARGETS[name] for name in args.targets]
    try:
        labels = _launches(args, gpu_build)
    except (MegaliteError, gpu_build.UnsupportedTriton) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="megalite-triton-cache-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # a first run's compile times
        start = time.perf_counter()
        jobs = gpu_build.jobs(list(labels), targets)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            built = list(pool.map(gpu_build.build, jobs))
        seconds = time.perf_counter() - start
    print_table(
        ["config", "tp x ep", "dtype", "call", "kernel", "candidate", "target", "shared KiB",
         "regs", "spilled B", "compile s", "status"],
        [[*labels[b.job.launch], *_cells(b)] for b in built],
        _notes(built, targets, seconds, args.jobs),
    )  # fmt: skip
    problems = gpu_build.problems(built)
    for problem in problems:
        print(f"would fail: {problem}")
    return 1 if problems else 0


def _shapes(config: str, layout: str, gpu_build) -> tuple[str, object]:
    """(tp x ep, the kernel sizes one rank of a config's model sees) in `layout`."""
    from megalite.config import load_config
    from megalite.tensor_parallel.layers import padded_vocab_size

    cfg = load_config(config, [])
    model = cfg.model
    tp, ep = (cfg.parallel.tp, cfg.parallel.ep) if layout == "own" else (1, 1)
    padded = padded_vocab_size(model.vocab_size, tp, model.vocab_round_to)
    return f"{tp}x{ep}", gpu_build.Shapes(
        hidden=model.hidden,
        head_dim=model.head_dim,
        heads=model.n_heads // tp,
        # with fewer K/V heads than ranks, each rank computes the one its query heads use
        kv_heads=max(model.n_kv_heads // tp, 1),
        ffn=model.ffn_hidden // tp,
        vocab=padded // tp,
        real_vocab=max(padded // tp - (padded - model.vocab_size), 0),
        experts=model.moe_experts // ep if model.moe_experts else None,
    )


def _launches(args: argparse.Namespace, gpu_build) -> dict:
    """Every launch of the chosen calls, configs, layouts and dtypes -> (config, tp x ep,
    dtype) it came from."""
    labels, known = {}, set()
    for config in args.configs:
        chosen = [_shapes(config, name, gpu_build) for name in LAYOUTS if name in args.layouts]
        for split, shapes in dict.fromkeys(chosen):  # the same sizes once
            for dtype in args.dtypes:
                known |= set(gpu_build.kernel_calls(shapes, DTYPES[dtype]))
                for launch in gpu_build.launches(shapes, DTYPES[dtype]):
                    if args.calls is None or launch.call in args.calls:
                        labels[launch] = (Path(config).stem, split, dtype)
    unknown = sorted(set(args.calls or ()) - known)
    if unknown:
        raise ConfigError(
            f"no kernel call named {', '.join(map(repr, unknown))} for these configs and dtypes; "
            f"--calls takes {', '.join(map(repr, sorted(known)))}"
        )
    return labels


def _cells(b) -> list[str]:
    """A built candidate's cells, from its call on."""
    job = b.job
    if b.error:
        status = "failed"
    elif not b.fits:
        status = "too much shared memory"
    else:
        status = "spills" if b.spilled else "ok"
    return [
        job.launch.call,
        job.launch.name,
        job.candidate,
        job.target.name,
        f"{b.shared / 1024:.1f}/{job.target.shared_memory // 1024}",
        str(b.registers),
        str(b.spilled),
        f"{b.seconds:.1f}",
        status,
    ]


def _notes(built: list, targets: list, seconds: float, jobs: int) -> list[str]:
    spilled = sum(1 for b in built if b.spilled)
    lines = [
        f"{len(built)} candidates compiled in {seconds:.0f} s ({jobs} at once; "
        f"{sum(b.seconds for b in built):.0f} s of compiling); {spilled} of them spill registers.",
        "targets: "
        + "; ".join(f"{t.name} ({t.gpus}): {t.shared_memory // 1024} KiB of shared memory a block"
                    for t in targets),
        "shared KiB: what the kernel needs / what the target has (a candidate that does not fit "
        "is one the autotuner skips); regs: per thread; spilled B: bytes per thread in local "
        "memory (ptxas's stack frame): slower, not wrong.",
    ]  # fmt: skip
    return lines


if __name__ == "__main__":
    sys.exit(main())
