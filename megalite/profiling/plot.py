"""`megalite plot RUN [RUN ...] [--out DIR]`: PNG figures of runs and profile reports.

A RUN is a run directory (train.out_dir) or a profile report (`profile.json`, written by
`megalite profile`). From each run directory's `metrics.jsonl`: loss and val loss against tokens
seen, tokens/s, MFU and peak memory, every run on the same axes (labelled by its directory's
name) to compare layouts. From each profile report (a file, or `profile.json` in a run
directory): stacked bars of every rank's memory and step-time breakdowns.

Figures are drawn on matplotlib `Figure` objects, rendered by Agg: no display, no pyplot state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalite.errors import MegaliteError

METRICS_FILE = "metrics.jsonl"
PROFILE_FILE = "profile.json"
GIB = 2**30

# Figures of the training metrics: file, title, y label, and per row the y value (or None).
CURVES: tuple[tuple[str, str, str, Any], ...] = (
    ("tokens_per_sec.png", "Throughput", "tokens/s", lambda row: row.get("tokens_per_sec")),
    ("mfu.png", "Model FLOPs utilisation", "MFU (%)", lambda row: _scaled(row.get("mfu"), 100)),
)
MEMORY_KEYS = {
    "peak_mem_allocated_bytes": "allocated",
    "peak_mem_reserved_bytes": "reserved",
    "peak_rss_bytes": "resident (CPU)",
}
"""Peak memory in a row (the worst rank's) and how the memory figure names it."""


class PlotError(MegaliteError):
    """A run or report to plot is missing, empty or not what megalite writes."""


@dataclass
class Run:
    """One run's metrics rows, the last row of each step (a resumed run may repeat steps)."""

    label: str
    rows: list[dict[str, Any]]


def tokens_seen(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Tokens trained on by the end of each step of `rows` (a run's rows, in step order): the
    running sum of each step's tokens, since a resume may change the global batch. A step
    without a row is taken at the batch of the next row."""
    seen, total, previous = {}, 0.0, 0
    for row in rows:
        total += (row["step"] - previous) * row["tokens_per_sec"] * row["step_time_s"]
        seen[row["step"]], previous = total, row["step"]
    return seen


def read_run(run_dir: Path, label: str) -> Run:
    """The metrics of a run directory, or a PlotError that says what is missing."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{path} does not exist: pass a train.out_dir of a run that logged metrics")
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PlotError(f"{path} line {number} is not JSON ({exc.msg})") from None
        by_step[row["step"]] = row
    if not by_step:
        raise PlotError(f"{path} is empty: train at least one step before plotting the run")
    return Run(label, [by_step[step] for step in sorted(by_step)])


def plot_runs(runs: list[Run], out_dir: Path) -> list[Path]:
    """The metrics figures of `runs`, all runs on each figure; returns the files written (a
    figure no run has data for, such as MFU on an unknown GPU, is left out)."""
    written = [_save(_loss_figure(runs), out_dir / "loss.png")]
    for name, title, ylabel, value in CURVES:
        fig, ax = _figure(title, "tokens seen", ylabel)
        if _draw_curves(ax, runs, value, ""):
            written.append(_save(fig, out_dir / name))
    fig, ax = _figure("Peak memory (worst rank)", "tokens seen", "GiB")
    drawn = [
        _draw_curves(ax, runs, lambda row, k=key: _scaled(row.get(k), 1 / GIB), f" {kind}")
        for key, kind in MEMORY_KEYS.items()
    ]
    if any(drawn):
        written.append(_save(fig, out_dir / "memory.png"))
    return written


def _loss_figure(runs: list[Run]) -> Any:
    fig, ax = _figure("Loss", "tokens seen", "loss")
    for run in runs:
        seen = tokens_seen(run.rows)
        (line,) = ax.plot(list(seen.values()), [r["loss"] for r in run.rows], label=run.label)
        evaluated = [r for r in run.rows if r.get("val_loss") is not None]
        if evaluated:
            ax.plot(
                [seen[r["step"]] for r in evaluated],
                [r["val_loss"] for r in evaluated],
                "o--",
                color=line.get_color(),
                label=f"{run.label} (val)",
            )
    ax.legend()
    return fig


def _draw_curves(ax: Any, runs: list[Run], value: Any, suffix: str) -> bool:
    """One line per run of `value(row)` over the rows that have it; whether any was drawn."""
    drawn = False
    for run in runs:
        rows = [row for row in run.rows if value(row) is not None]
        if rows:
            seen = tokens_seen(run.rows)
            x = [seen[row["step"]] for row in rows]
            ax.plot(x, [value(row) for row in rows], label=run.label + suffix)
            drawn = True
    if drawn:
        ax.legend()
    return drawn


def plot_profile(report_path: Path, out_dir: Path, name: str) -> list[Path]:
    """Stacked bars of every rank's memory parts and step-time parts (ms) from a `megalite
    profile` report, whichever parts it holds, as `profile_<name>_{memory,time}.png`."""
    try:
        ranks = json.loads(report_path.read_text())["ranks"]
        memory = [rank.get("memory_bytes", {}) for rank in ranks]
        times = [rank.get("time_s", {}) for rank in ranks]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise PlotError(
            f"{report_path} is not a profile report: write one with `megalite profile`"
        ) from None
    axes = ("tp", "cp", "pp", "dp") if any(r.get("cp_rank") for r in ranks) else ("tp", "pp", "dp")
    ticks = [_rank_tick(rank, axes) for rank in ranks]
    largest = max((sum(parts.values()) for parts in memory), default=0)
    memory_unit = ("GiB", 1 / GIB) if largest >= GIB else ("MiB", 1 / 2**20)
    written = []
    for kind, title, parts, (unit, scale) in (
        ("memory", "Memory per rank", memory, memory_unit),
        ("time", "Step time per rank", times, ("ms", 1e3)),
    ):
        if any(parts):
            fig, ax = _figure(f"{title} ({name})", f"rank ({', '.join(axes)})", unit)
            scaled = [{part: v * scale for part, v in rank.items()} for rank in parts]
            _stacked_bars(ax, ticks, scaled)
            written.append(_save(fig, out_dir / f"profile_{name}_{kind}.png"))
    return written


def _rank_tick(rank: dict[str, Any], axes: tuple[str, ...]) -> str:
    """The rank and its coordinates on `axes` (cp where the report has context parallelism)."""
    coords = [rank.get(f"{axis}_rank") for axis in axes]
    label = str(rank.get("rank", "?"))
    return label if None in coords else f"{label}\n({', '.join(map(str, coords))})"


def _stacked_bars(ax: Any, ticks: list[str], parts: list[dict[str, float]]) -> None:
    names = list(dict.fromkeys(name for rank in parts for name in rank))  # first-seen order
    bottom = [0.0] * len(parts)
    for name in names:
        heights = [rank.get(name, 0.0) for rank in parts]
        ax.bar(range(len(parts)), heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(range(len(parts)), ticks)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # rendered by Agg on save; imported only to plot

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def plot(sources: list[Path], out_dir: Path | None = None) -> list[Path]:
    """Every figure of `sources` (run directories and profile reports) under `out_dir`
    (default: `<source>/plots` for one source, `./plots` for several); returns the files."""
    if out_dir is None:
        one = sources[0]
        out_dir = (one if one.is_dir() else one.parent) / "plots" if len(sources) == 1 else None
    out_dir = out_dir or Path("plots")
    runs, reports = [], []
    for source, label in zip(sources, _labels(sources), strict=True):
        if not source.exists():
            raise PlotError(f"{source} does not exist: pass a run directory or a profile report")
        if source.is_file():
            reports.append((source, label))
            continue
        has_report = (source / PROFILE_FILE).is_file()
        if has_report:
            reports.append((source / PROFILE_FILE, label))
        if (source / METRICS_FILE).is_file() or not has_report:
            runs.append(read_run(source, label))
    written = plot_runs(runs, out_dir) if runs else []
    for report, label in reports:
        written += plot_profile(report, out_dir, label)
    return written


def _labels(sources: list[Path]) -> list[str]:
    """Each source's name: its directory's (a report: the directory it is in), or its whole
    path where two sources would share a name."""
    names = [(s.resolve().parent if s.is_file() else s.resolve()).name for s in sources]
    if len(set(names)) < len(names):
        return [str(s).replace("/", "_").strip("_.") for s in sources]
    return names
