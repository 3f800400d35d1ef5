"""`megalite plot`: the command line of `profiling.plot` (the figures are described there)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _run_plot(args: argparse.Namespace) -> int:
    from megalite.profiling.plot import plot

    for path in plot(args.runs, args.out):
        print(f"wrote {path}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `megalite plot`."""
    parser = commands.add_parser(
        "plot",
        help="PNG figures of runs (loss, tokens/s, MFU, memory) and profile reports",
        description="Figures of one or several runs on the same axes, to compare layouts: loss "
        "and val loss against tokens seen, tokens/s, MFU and peak memory from each run's "
        "metrics.jsonl; and from a `megalite profile` report (profile.json) stacked bars of "
        "every rank's memory and step-time breakdowns.",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        type=Path,
        metavar="RUN",
        help="a run directory (train.out_dir) or a profile report (profile.json)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where the PNGs go (default: RUN/plots for one RUN, ./plots for several)",
    )
    parser.set_defaults(func=_run_plot)
