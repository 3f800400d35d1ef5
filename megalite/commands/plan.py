"""`megalite plan`: the command line of `profiling.plan` (how layouts are ranked is said there):
the machine described by the flags, and the ranked table with each proposal's command."""

from __future__ import annotations

import argparse
import os
import re
from typing import TYPE_CHECKING

from megalite.config import Config, load_config
from megalite.hardware import cpu_cores, cpu_peak_flops, gpu_peak_flops
from megalite.profiling.plan import GIB, PlanError, Proposal, plan

if TYPE_CHECKING:  # the CLI imports this module for its parser: keep torch out of that
    from megalite.profiling.throughput import Machine

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_GPU = "H100 SXM"
# device: (mfu fraction, intra-node Gbit/s, inter-node Gbit/s, optimizer GB/s, ms per layer and
# micro-batch, ms per message, reduce-scatter / all-gather cost relative to a ring's). CPU, from
# 8 gloo ranks of gpt-tiny on 2 cores: about 80 % of the measured peak; larger micro-batches were
# not faster (no per-layer overhead to save); every tp collective or p2p message cost about 5 ms
# (ranks wait for their peer's turn on a core); an all-reduce of 21 MB took 0.2 s, i.e. each
# rank's share of the 2 cores moved its ring bytes at about 6 Gbit/s. On a machine of its own a
# rank waiting in a bubble lends all its core time (pp 4 x dp 2 was the fastest layout measured,
# 24 % ahead of dp 8); only where other work shares the cores is part of it lost (measured while
# other jobs ran: 40 %; pass a lower `Machine.bubble_lent` to model that).
DEFAULTS = {
    "cuda": (0.5, 2400.0, 400.0, 2000.0, 0.05, 0.02, 1.0, 1.0),
    "cpu": (0.8, 6.0, 6.0, 4.0, 0.0, 5.0, 2.0, 1.0),
}


def parse_memory(text: str) -> float:
    """'80GB' (10^9 bytes), '80GiB' (2^30), '512 MB', '1.5TB' or plain bytes -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    if not match or float(match[1]) <= 0:
        raise PlanError(
            f"--gpu-memory {text!r} is not a memory size: write it like 80GB, 80GiB or 512MB"
        )
    return float(match[1]) * UNITS[(match[2] or "").lower()]


def machine_from_args(args: argparse.Namespace, base: Config) -> Machine:
    """The hardware described on the command line, defaults filled in per device."""
    from megalite.profiling.estimate import resolve_precision
    from megalite.profiling.throughput import Machine

    _check(args.gpus >= 1, f"--gpus must be >= 1, got {args.gpus}")
    _check(
        args.nodes >= 1 and args.gpus % args.nodes == 0,
        f"--nodes {args.nodes} must divide --gpus {args.gpus} (ranks per node are equal)",
    )
    mfu, intra, inter, optimizer, overhead_ms, latency_ms, split, lent = DEFAULTS[args.device]
    mfu = args.mfu_fraction if args.mfu_fraction is not None else mfu
    _check(0 < mfu <= 1, f"--mfu-fraction must be in (0, 1], got {mfu}")
    intra = args.intra_node_gbps if args.intra_node_gbps is not None else intra
    inter = args.inter_node_gbps if args.inter_node_gbps is not None else inter
    _check(intra > 0 and inter > 0, "link bandwidths (--intra/--inter-node-gbps) must be > 0")
    precision = resolve_precision(base.train.precision, args.device)
    if args.peak_tflops is not None:
        _check(args.peak_tflops > 0, f"--peak-tflops must be > 0, got {args.peak_tflops}")
        peak = args.peak_tflops * 1e12
    elif args.device == "cpu":
        peak = cpu_peak_flops(precision)  # this machine's, measured once and cached
    else:
        peak = gpu_peak_flops(DEFAULT_GPU, precision)
    if args.gpu_memory is not None:
        memory = parse_memory(args.gpu_memory)
    elif args.device == "cpu":  # the ranks share this machine's RAM
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / args.gpus
    else:
        raise PlanError("--gpu-memory is needed for GPUs: the memory of one, e.g. 80GB")
    return Machine(
        device=args.device,
        world_size=args.gpus,
        nodes=args.nodes,
        memory_bytes=memory,
        peak_flops=peak,
        mfu_fraction=mfu,
        intra_node_bandwidth=intra * 1e9 / 8,
        inter_node_bandwidth=inter * 1e9 / 8,
        memory_bandwidth=optimizer * 1e9,
        layer_overhead_s=overhead_ms / 1e3,
        latency_s=latency_ms / 1e3,
        split_collective_cost=split,
        bubble_lent=lent,
        cores=cpu_cores() if args.device == "cpu" else 1,
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise PlanError(message)


def print_plan(proposals: list[Proposal], machine: Machine) -> None:
    """The ranked table, then the command line of each proposal."""
    where = f"{machine.world_size} {'CPU ranks' if machine.device == 'cpu' else 'GPUs'}"
    print(
        f"{where} on {machine.nodes} node(s), {machine.memory_bytes / GIB:.1f} GiB each, "
        f"{machine.peak_flops / 1e12:.2f} TFLOP/s peak at {machine.mfu_fraction:.0%}"
    )
    shown = [p.layout.describe(p.dp) + f" m {p.microbatches}" for p in proposals]
    width = max(34, *map(len, shown))
    header = f"{'#':>2}  {'layout':<{width}} {'recompute':<9} {'step s':>8} {'tokens/s':>10}  why"
    print(header + "\n" + "-" * len(header))
    for i, (p, layout) in enumerate(zip(proposals, shown, strict=True), 1):
        print(
            f"{i:>2}  {layout:<{width}} {p.layout.recompute:<9} {p.prediction.step_s:>8.3f} "
            f"{p.prediction.tokens_per_s:>10,.0f}  {'; '.join(p.reasons)}"
        )
    for i, p in enumerate(proposals, 1):
        print(f"\n{i}: {p.command}")


def _run_plan(args: argparse.Namespace) -> int:
    base = load_config(args.config, args.overrides)
    machine = machine_from_args(args, base)
    _check(args.top >= 1, f"--top must be >= 1, got {args.top}")
    proposals = plan(args.config, args.overrides, base, machine, args.top, progress=True)
    print_plan(proposals, machine)
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `megalite plan`."""
    parser = commands.add_parser(
        "plan",
        help="rank the layouts of a config on N devices",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--config", help="YAML config (see configs/); defaults when omitted")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument(
        "--gpus", type=int, required=True, help="devices (with --device cpu: gloo ranks here)"
    )
    parser.add_argument("--gpu-memory", help="memory of one device, e.g. 80GB or 80GiB")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over")
    parser.add_argument("--intra-node-gbps", type=float, help="Gbit/s between ranks in a node")
    parser.add_argument("--inter-node-gbps", type=float, help="Gbit/s between nodes, per rank")
    parser.add_argument(
        "--peak-tflops", type=float, help=f"dense peak of one device (default {DEFAULT_GPU})"
    )
    parser.add_argument("--mfu-fraction", type=float, help="share of the peak matmuls reach")
    parser.add_argument("--top", type=int, default=5, help="how many layouts to show")
    parser.set_defaults(func=_run_plan)
