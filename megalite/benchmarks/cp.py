"""Context-parallel attention: the ring (`parallel.cp_comm=p2p`) against all-gathered K/V
(`allgather`), one attention layer's forward + backward on each of cp ranks.

Each rank holds its 2 chunks of the 2*cp of every sequence (`context_parallel.layout`) and runs
`context_parallel.attention.chunked_attention` on random q/k/v of that size. The table gives,
per mode, the median time of forward + backward, the causal attention TFLOP/s of one rank (a
whole sequence's FLOPs over cp), and the bytes a rank sends per layer (K/V, and dK/dV back).
cp 1 is the kernel alone: the ideal the cp rows are measured against (time x cp).

    python tools/bench_cp.py --seq 4096 --cp 2            # gloo ranks on this machine
    torchrun --nproc-per-node 4 tools/bench_cp.py --seq 32768 --heads 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from megalite import comm
from megalite.benchmarks.table import print_table
from megalite.context_parallel.attention import chunked_attention
from megalite.context_parallel.layout import SequenceLayout
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state, choose_device, init_distributed


def options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="ranks (gloo on CPU when not under torchrun)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: bf16 on GPU")
    p.add_argument("--steps", type=int, default=5, help="timed forward + backward passes")
    p.add_argument("--warmup", type=int, default=2)
    return p


def _causal_flops(args: argparse.Namespace) -> float:
    """Forward (QK^T and PV, half the pairs) and backward (2.5 x forward) of one sequence."""
    forward = 2 * 2 * args.batch * args.heads * args.seq**2 * args.head_dim / 2
    return 3.5 * forward


def _measure(args: argparse.Namespace, ps: Any, mode: str) -> dict[str, float]:
    device, cp = ps.device, ps.size("cp")
    dtype = (
        torch.bfloat16
        if (args.dtype or ("bf16" if device.type == "cuda" else "fp32")) == "bf16"
        else torch.float32
    )
    local = args.seq // cp
    gen = torch.Generator(device=device).manual_seed(ps.rank)
    shape = (args.batch, local)
    q = torch.randn(*shape, args.heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    k, v = (
        torch.randn(*shape, args.kv_heads, args.head_dim, device=device, dtype=dtype, generator=gen)
        for _ in range(2)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    grad = torch.randn_like(q)
    layout = SequenceLayout.build(args.seq, cp, ps.coord("cp"), device)  # cp 1: the kernel alone

    def once() -> None:
        out = chunked_attention(
            q, k, v, layout, ps.ranks("cp"), ps.coord("cp"), ps.group("cp"), mode
        )
        out.backward(grad)

    times = []
    for step in range(args.warmup + args.steps):
        comm.barrier(ps.group("cp"))
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    with comm.record_collectives() as records:
        once()
    sent = sum(
        r.bytes * (r.group_size - 1) / max(r.group_size, 1) if r.group_size > 1 else r.bytes
        for r in records
    )
    return {"ms": statistics.median(times) * 1e3, "sent": sent}


def measure(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    device = choose_device("auto")
    init_distributed(device)
    ps = build_parallel_state(1, 1, device, cp=args.cp)
    rows = []
    for mode in ("p2p", "allgather") if ps.size("cp") > 1 else ("p2p",):
        result = _measure(args, ps, mode)
        worst = torch.tensor([result["ms"]], device=device)
        comm.all_reduce_max(worst, ps.world_group)
        rows.append({"mode": mode, "ms": worst.item(), "sent": result["sent"]})
    return rows if ps.rank == 0 else None


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    flops = _causal_flops(args) / args.cp
    table = []
    for row in rows:
        mode = row["mode"] if args.cp > 1 else "kernel alone (cp 1)"
        tflops = flops / (row["ms"] / 1e3) / 1e12
        table.append([mode, f"{row['ms']:.2f}", f"{tflops:.3f}", f"{row['sent'] / 2**20:.2f}"])
    print_table(
        ["cp_comm", "fwd+bwd ms", "TFLOP/s per rank", "MiB sent per rank"],
        table,
        [
            f"cp {args.cp}, sequence {args.seq} ({args.seq // args.cp} tokens per rank), batch "
            f"{args.batch}, {args.heads} heads ({args.kv_heads} kv heads) x {args.head_dim}; the "
            "slowest rank's median; TFLOP/s count the causal half of the score matrix.",
        ],
    )


def _rank_main(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    return measure(args)


def main(argv: list[str] | None = None) -> None:
    args = options().parse_args(argv)
    if "RANK" in os.environ or args.cp == 1:
        if "WORLD_SIZE" in os.environ:
            args.cp = int(os.environ["WORLD_SIZE"])
        rows = measure(args)
        if dist.is_initialized():
            dist.destroy_process_group()
    else:
        rows = run_ranks(args.cp, _rank_main, args, timeout=1800.0)[0]
    if rows is not None:
        report(args, rows)


if __name__ == "__main__":
    main()
