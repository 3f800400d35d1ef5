"""Start-up cost of initialising one rank's weights: shard-only against full-tensor draws.

megalite draws only the blocks of each global tensor that the rank's tp shard overlaps
(`megalite.tensor_parallel.random.draw_shard`). The baseline is the method it replaced, kept
here only: draw every global tensor whole from one stream, on one CPU thread, and keep the
shard. Each (model, layout, method) runs in fresh processes, fp32, with real values (no meta
tensors: one rank of these layouts fits in host memory), and reports

- values: how many values the init functions fill (the baseline: every global tensor whole),
- seconds: wall time of the initialisation alone (the model is built beforehand, unfilled),
  the fastest of --repeat processes, since other work on a shared machine only adds time,
- peak MiB: the process's peak resident memory minus its memory before initialising, which
  includes the rank's own weights when they live on the CPU (the same for both methods) and
  what each method allocates on the side.

The rank is tp rank 0 on the first pipeline stage (it holds the embedding), with one intra-op
thread as torchrun gives each of several ranks on a node (OMP_NUM_THREADS=1). With --device
cuda its weights live on the GPU and the time includes copying them there.

    python tools/bench_init.py                 # gpt2-1.3b and llama-7b layouts
    python tools/bench_init.py --layout configs/llama-7b.yaml:tp=8,pp=4,vpp=2
    python -m megalite.benchmarks.init         # the same, from an installed megalite
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from megalite.benchmarks.table import print_table
from megalite.config import load_config
from megalite.models.factory import build_chunks
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom, global_tensors, init_parameters
from megalite.tensor_parallel.random import param_seed

LAYOUTS = [
    "configs/gpt2-1.3b.yaml:tp=2,pp=1,vpp=1",  # the config's own layout
    "configs/gpt2-1.3b.yaml:tp=8,pp=2,vpp=1",
    "configs/llama-7b.yaml:tp=8,pp=2,vpp=2",  # the config's own layout
]


@torch.no_grad()
def full_tensor_init(model: torch.nn.Module, seed: int, ps: ParallelState) -> int:
    """The baseline: every parameter's whole global tensor from one (seed, name) stream, then
    this rank's shard kept. Returns the values drawn."""
    drawn = 0
    for name, param in global_tensors(dict(model.named_parameters())).items():
        meta = param.meta
        generator = torch.Generator().manual_seed(param_seed(seed, meta.tied_name or name))
        full = torch.zeros(meta.global_shape)
        real = full if meta.init_rows is None else full[: meta.init_rows]
        meta.init(real, generator)
        drawn += real.numel()
        if meta.tp_split_dim is not None:
            full = full.chunk(ps.size("tp"), dim=meta.tp_split_dim)[ps.coord("tp")]
        param.copy_(full)
    return drawn


def shard_only_init(model: torch.nn.Module, seed: int, ps: ParallelState) -> int:
    """megalite's initialisation, with each init function wrapped to count the values filled."""
    drawn = 0
    for param in global_tensors(dict(model.named_parameters())).values():
        init = param.meta.init

        def counted(block: torch.Tensor, generator: torch.Generator, init=init) -> None:
            nonlocal drawn
            drawn += block.numel()
            init(block, generator)

        param.meta.init = counted
    init_parameters(model, seed, ps)
    return drawn


METHODS = {"full tensor": full_tensor_init, "shard only": shard_only_init}


def parse_layout(spec: str) -> tuple[str, dict[str, int]]:
    """'CONFIG:tp=T,pp=P,vpp=V' -> (CONFIG, {"tp": T, "pp": P, "vpp": V})."""
    config, sizes = spec.split(":")
    return config, {k: int(v) for k, v in (item.split("=") for item in sizes.split(","))}


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(spec: str, method: str, device: str, threads: int) -> dict[str, float]:
    """Build tp rank 0 / pp rank 0 of the layout unfilled, then initialise it with `method`."""
    torch.set_num_threads(threads)
    config, sizes = parse_layout(spec)
    cfg = load_config(config, [f"parallel.{k}={v}" for k, v in sizes.items()])
    one_replica = cfg.parallel.dims(cfg.parallel.tp * cfg.parallel.pp)  # dp 1
    ps = ParallelState(one_replica, 0, torch.device(device))
    chunks = build_chunks(cfg, ps, TPRandom(cfg.train.seed, ps), random_init=False)
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    before = peak_rss_bytes()
    start = time.perf_counter()
    drawn = sum(METHODS[method](chunk, cfg.train.seed, ps) for chunk in chunks)
    if ps.device.type == "cuda":
        torch.cuda.synchronize(ps.device)
    seconds = time.perf_counter() - start
    return {
        "params": params,
        "drawn": drawn,
        "seconds": seconds,
        "peak_bytes": peak_rss_bytes() - before,
    }


def options() -> argparse.ArgumentParser:
    """This benchmark's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layout",
        action="append",
        help="CONFIG:tp=T,pp=P,vpp=V (repeatable; default: gpt2-1.3b and llama-7b layouts)",
    )
    parser.add_argument("--method", choices=list(METHODS), action="append")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="processes per row (fastest wins)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--one", nargs=2, metavar=("LAYOUT", "METHOD"), help=argparse.SUPPRESS)
    return parser


def measure_in_fresh_processes(args: argparse.Namespace, spec: str, method: str) -> dict:
    """The fastest of --repeat processes that each start cold and measure once (`--one`): a
    process's peak memory only counts what that process did."""
    # __spec__.name, not __name__: that is "__main__" under `python -m`
    child = [sys.executable, "-m", __spec__.name, "--one", spec, method]
    child += ["--device", args.device, "--threads", str(args.threads)]
    results = [
        json.loads(subprocess.run(child, check=True, capture_output=True).stdout)
        for _ in range(args.repeat)
    ]
    return min(results, key=lambda r: r["seconds"])


def run(args: argparse.Namespace) -> list[list[str]]:
    """One table row per (layout, method), each also printed to stderr as it is measured."""
    rows = []
    for spec in args.layout or LAYOUTS:
        for method in args.method or list(METHODS):
            result = measure_in_fresh_processes(args, spec, method)
            config, sizes = parse_layout(spec)
            rows.append(
                [
                    config.split("/")[-1].removesuffix(".yaml"),
                    " ".join(f"{k} {v}" for k, v in sizes.items()),
                    f"{result['params'] / 1e6:,.0f}",
                    method,
                    f"{result['drawn'] / 1e6:,.0f}",
                    f"{result['seconds']:.1f}",
                    f"{result['peak_bytes'] / 2**20:,.0f}",
                ]
            )
            print("  ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def report(args: argparse.Namespace, rows: list[list[str]]) -> None:
    """Print the table of `run`'s rows."""
    columns = ["model", "layout", "rank M params", "method", "M values", "seconds", "peak MiB"]
    notes = [
        f"weights on {args.device}, drawn on CPU, fp32; torch {torch.__version__}, "
        f"{args.threads} intra-op thread(s); fastest of {args.repeat} processes per row; "
        "tp rank 0 of the first pipeline stage.",
        "peak MiB: peak resident memory over the process's memory before initialising, the "
        "rank's own weights included.",
    ]
    print_table(columns, rows, notes)


def main(argv: list[str] | None = None) -> None:
    args = options().parse_args(argv)
    if args.one:  # a child process: one measurement, as JSON
        print(json.dumps(measure(*args.one, args.device, args.threads)))
        return
    report(args, run(args))


if __name__ == "__main__":
    main()
