"""`megalite profile`: the command line of `profiling.profile` (what it measures and reports is
said there)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _run_profile(args: argparse.Namespace) -> int:
    from megalite.config import load_config
    from megalite.profiling.profile import profile

    cfg = load_config(args.config, args.overrides)
    profile(cfg, args.warmup_steps, args.steps, args.trace, args.out)
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `megalite profile`."""
    parser = commands.add_parser(
        "profile",
        help="measure a layout's training step per rank: throughput, MFU, time and memory",
        description="Build the run as `megalite train` does, run warm-up steps, then measure "
        "the training step on every rank (nothing is saved). Launch it like training: plain, or "
        "with `torchrun --nproc-per-node N -m megalite profile ...`.",
    )
    parser.add_argument("--config", help="YAML config (see configs/); defaults when omitted")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="e.g. parallel.pp=2"
    )
    parser.add_argument("--warmup-steps", type=int, default=2, metavar="N")
    parser.add_argument("--steps", type=int, default=5, metavar="M", help="measured steps")
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="also trace --steps more steps with torch.profiler, one file per rank here (timed "
        "apart: the profiler's cost stays out of the rates)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="FILE", help="the JSON report (<train.out_dir>/profile.json)"
    )
    parser.set_defaults(func=_run_profile)
