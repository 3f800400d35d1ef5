"""Float8 training against the compute dtype on the same run: gpt-tiny (by default), 300 steps
on the builtin corpus, once in the training precision (`train.precision=auto`: bf16 on a GPU,
fp32 on the CPU) and once under each `train.fp8` recipe, every GEMM in float8
(`train.fp8_min_dim=0`: gpt-tiny's widths are below the default's 1024). Prints each run's
final validation loss and its gap to the baseline's (the target: within 2 %), and plots the
curves, training and validation loss against tokens seen (`megalite plot`'s figures), of all
runs together.

    python tools/fp8_convergence.py                          # gpt-tiny, 300 steps
    python tools/fp8_convergence.py --steps 50 train.eval_interval=25
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from megalite.benchmarks.table import print_table

RECIPES = ("none", "tensorwise", "rowwise")
TARGET = 0.02
"""The largest relative gap of a float8 run's final validation loss to the baseline's."""


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="configs/gpt-tiny.yaml", help='YAML config ("": the defaults)'
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument(
        "--out", type=Path, help="a new directory for the runs and the plot (default: runs/...)"
    )
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser


def train_one(config: str | None, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """Train one run; its final validation loss, median tokens/s and wall time."""
    from megalite.config import load_config
    from megalite.training.loop import train

    start = time.perf_counter()
    train(load_config(config or None, [*overrides, f"train.out_dir={out_dir}"]))
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row["val_loss"] for row in rows if row.get("val_loss") is not None]
    speeds = sorted(row["tokens_per_sec"] for row in rows if row.get("tokens_per_sec"))
    return {
        "val_loss": evaluated[-1] if evaluated else float("nan"),
        "loss": rows[-1]["loss"],
        "tokens_s": speeds[len(speeds) // 2] if speeds else float("nan"),
        "seconds": time.perf_counter() - start,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each recipe's run under `args.out`, the baseline ("none") first."""
    base = [
        f"train.steps={args.steps}",
        "train.fp8_min_dim=0",
        "checkpoint.interval=0",
        "logging.progress=false",
        *args.overrides,
    ]
    results = []
    for recipe in args.recipes:
        out_dir = args.out / recipe
        result = train_one(args.config, [*base, f"train.fp8={recipe}"], out_dir)
        results.append({"recipe": recipe, "out_dir": out_dir, **result})
    return results


def gap(row: dict[str, Any], baseline: dict[str, Any] | None) -> float | None:
    """The run's final validation loss relative to the baseline's (None: no baseline)."""
    if baseline is None or row is baseline:
        return None
    return (row["val_loss"] - baseline["val_loss"]) / baseline["val_loss"]


def _label(row: dict[str, Any]) -> str:
    return "baseline" if row["recipe"] == "none" else f"fp8 {row['recipe']}"


def report(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """The table, a line per run, and the plot of every run's curves; returns the figures."""
    from megalite.profiling.plot import plot_runs, read_run

    baseline = next((r for r in results if r["recipe"] == "none"), None)
    rows = []
    for row in results:
        relative = gap(row, baseline)
        rows.append(
            [
                _label(row),
                f"{row['loss']:.4f}",
                f"{row['val_loss']:.4f}",
                "" if relative is None else f"{relative * 100:+.2f} %",
                f"{row['tokens_s']:,.0f}",
                f"{row['seconds']:.0f}",
            ]
        )
    runs = [read_run(r["out_dir"], _label(r)) for r in results]
    figures = plot_runs(runs, out / "plots")
    notes = [
        f"target: a float8 run's final val loss within {TARGET:.0%} of the baseline's",
        f"curves: {figures[0]}",
    ]
    columns = ["run", "last loss", "final val loss", "vs baseline", "tokens/s", "seconds"]
    print_table(columns, rows, notes)
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run and report; exit status 1 if a float8 run misses the target."""
    args = options().parse_intermixed_args(argv)
    if args.out is None:
        args.out = Path("runs") / f"fp8-convergence-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.out.exists():
        raise SystemExit(f"error: {args.out} exists: pass --out a new directory")
    results = run(args)
    report(results, args.out)
    baseline = next((r for r in results if r["recipe"] == "none"), None)
    missed = [r for r in results if (g := gap(r, baseline)) is not None and abs(g) > TARGET]
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
