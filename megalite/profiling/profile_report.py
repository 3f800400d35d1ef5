"""The report of `megalite profile`: every rank's measurements gathered, the rates and the
simulated bubble derived from them, and where it goes (console table, JSON, trackers).

JSON layout (what `megalite plot` reads): top-level `config`, `world_size`, `layout` (tp, cp,
cp_comm, pp, dp, ...), `total` and `ranks`, a list with per rank `rank`, `tp_rank`, `cp_rank`,
`pp_rank`, `dp_rank`, `tokens_per_sec`,
`tflops` (model TFLOP/s per device), `mfu`, `step_time_s` (the rank's median measured step),
`step_time_min_s` and `step_time_max_s` (its fastest and slowest measured step),
`traced_step_time_s` (the median step under `--trace`'s profiler, null without it: never in the
rates), `time_s` (the disjoint parts of the median step, which add up to `step_time_s`;
communication exposed by axis: `tp_comm_exposed`, `cp_comm_exposed`, `dp_comm_exposed`,
`other_comm_exposed`; `step_timing` says what each axis counts), `comm_overlapped_s` (by axis:
`tp`, `cp`, `dp`, `other`; beside compute, so not a part of the step),
`weight_s` (the part of `time_s.backward` a split backward's W steps took; 0 without one),
`bubble`, `memory_bytes` (the parts a rank holds, which add up to `memory_total_bytes`) and
`counts`, one more steady step counted (`launch_count`): `launches`, `compiled_kernels`,
`graph_calls` and `host_syncs`, each by phase (`forward`, `backward`, `optimizer`, `other`) and
`total`, and `compiled_graphs`, `graph_breaks`, `recompiles`. Top-level `counted_step` holds this
rank's `sync_sites` (`"<kind> at <file>:<line>"` -> syncs) and `graph_breaks` by reason.

The rates are those of a steady training step, timed as `megalite train` times its steps (the
step on this rank, reading the batch outside it, up to the compute stream's end): what its
metrics rows log for the same layout (the total at the slowest rank, as their
`step_time_max_s`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from megalite import comm
from megalite.config import Config, config_to_dict
from megalite.pipeline.schedule import build_schedule, v_shaped, virtual_stage
from megalite.pipeline.simulate import simulate
from megalite.profiling.estimate import LayoutEstimate, estimate_layout
from megalite.profiling.launch_count import PHASES, PhaseCounts, StepCounts
from megalite.profiling.step_timing import AXES, TIME_PARTS
from megalite.training.metrics import StepCost
from megalite.training.setup import Run
from megalite.training.trackers import new_tracker_id, start_trackers

COORDS = ("rank", "tp_rank", "cp_rank", "pp_rank", "dp_rank")
GPU_PEAKS = ("peak_allocated", "peak_reserved")
"""Allocator figures of a GPU: totals, not parts, so kept beside `memory_bytes`."""
PER_PHASE = tuple(f.name for f in dataclasses.fields(PhaseCounts))
"""What the counted step counts in each phase."""
COMPILE_COUNTS = ("compiled_graphs", "graph_breaks", "recompiles")
"""What it counts of compilation, once per rank."""


def count_values(counts: StepCounts) -> dict[str, float]:
    """The counted step's numbers as gathered values: `count.<what>.<phase>` for every phase of
    a step (0 where nothing ran in it) and `count.<compile count>`."""
    values = {
        f"count.{what}.{phase}": getattr(counts.phases.get(phase, PhaseCounts()), what)
        for what in PER_PHASE
        for phase in PHASES
    }
    values["count.compiled_graphs"] = counts.compiled_graphs
    values["count.graph_breaks"] = sum(counts.graph_breaks.values())
    values["count.recompiles"] = counts.recompiles
    return values


def count_entry(row: dict[str, float]) -> dict[str, Any]:
    """A rank's `counts` from its gathered `count_values`."""
    entry: dict[str, Any] = {}
    for what in PER_PHASE:
        by_phase = {phase: int(row[f"count.{what}.{phase}"]) for phase in PHASES}
        entry[what] = by_phase | {"total": sum(by_phase.values())}
    return entry | {what: int(row[f"count.{what}"]) for what in COMPILE_COUNTS}


def gather_ranks(run: Run, values: dict[str, float]) -> list[dict[str, float]]:
    """Every rank's `values` (the same keys on every rank), in rank order. Collective."""
    ps = run.ps
    keys = sorted(values)
    table = torch.zeros(ps.world_size, len(keys), dtype=torch.float64, device=ps.device)
    table[ps.rank] = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    comm.all_reduce(table, ps.world_group)
    return [dict(zip(keys, row)) for row in table.tolist()]


def layout_of(cfg: Config, world_size: int) -> dict[str, Any]:
    p, t = cfg.parallel, cfg.train
    dp, microbatches = cfg.layout_for_world(world_size)
    return {
        "tp": p.tp,
        "cp": p.cp,
        "cp_comm": p.cp_comm,
        "ep": p.ep,
        "pp": p.pp,
        "dp": dp,
        "vpp": p.vpp,
        "schedule": p.schedule,
        "sp": p.sp,
        "zero": p.zero,
        "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "microbatches": microbatches,
    }


def simulated_bubble(cfg: Config, layout: dict[str, Any], ranks: list[dict[str, Any]]) -> float:
    """The simulator's bubble (idle relative to compute) for this schedule, with each virtual
    stage's forward and backward cost (and, of the backward, its W steps' under a split
    backward) as measured on its pp rank (mean over its replicas)."""
    pp, vpp, m, kind = layout["pp"], layout["vpp"], layout["microbatches"], layout["schedule"]
    costs = {"forward": [0.0] * (pp * vpp), "backward": [0.0] * (pp * vpp)}
    costs["weight"] = [0.0] * (pp * vpp)
    for pp_rank in range(pp):
        mine = [r for r in ranks if r["pp_rank"] == pp_rank]
        for chunk in range(vpp):
            stage = virtual_stage(pp_rank, chunk, pp, v_shaped(kind))
            for part, per_stage in costs.items():
                seconds = (r["weight_s"] if part == "weight" else r["time_s"][part] for r in mine)
                per_stage[stage] = statistics.fmean(seconds) / (m * vpp)
    group = cfg.parallel.microbatch_group_size
    schedules = [build_schedule(kind, pp, r, m, vpp, group) for r in range(pp)]
    split = any(c > 0 for c in costs["weight"])
    return simulate(
        schedules,
        pp,
        vpp,
        costs["forward"],
        costs["backward"],
        weight_cost=costs["weight"] if split else None,
        v_shape=v_shaped(kind),
    ).bubble_ratio


def rank_entry(row: dict[str, float], cost: StepCost) -> dict[str, Any]:
    """One rank's part of the report from its gathered row."""
    step_s = row["step"]
    tflops = cost.flops / cost.devices / step_s / 1e12
    peak = cost.peak_for(tflops * 1e12)
    memory = {k.removeprefix("mem."): int(v) for k, v in row.items() if k.startswith("mem.")}
    entry: dict[str, Any] = {k: int(row[k]) for k in COORDS}
    entry.update(
        step_time_s=step_s,
        step_time_min_s=row["step_min"],
        step_time_max_s=row["step_max"],
        traced_step_time_s=row["traced_step"] or None,
        tokens_per_sec=cost.tokens / step_s,
        tflops=tflops,
        mfu=tflops * 1e12 / peak if peak else None,
        time_s={part: row[part] for part in TIME_PARTS},
        weight_s=row["weight"],
        comm_overlapped_s={axis: row[f"{axis}_comm_overlapped"] for axis in AXES},
        bubble=row["bubble"] / (row["forward"] + row["backward"]),
        expert_imbalance=row["expert_imbalance"],
        dropped_tokens=int(row["dropped_tokens"]),
        memory_bytes={k: v for k, v in memory.items() if k not in GPU_PEAKS},
        counts=count_entry(row),
    )
    # what the device holds, like the estimate's total: host-resident parts (`*_host`) aside
    device_parts = {k: v for k, v in entry["memory_bytes"].items() if not k.endswith("_host")}
    entry["memory_total_bytes"] = sum(device_parts.values())
    entry.update({f"{k}_bytes": memory[k] for k in GPU_PEAKS if k in memory})
    return entry


def add_estimates(ranks: list[dict[str, Any]], estimate: LayoutEstimate) -> None:
    """Put the closed-form estimate of each rank's pipeline stage beside its measurement
    (`estimate_bytes` by part, `estimate_total_bytes` at the rank's peak)."""
    for entry in ranks:
        stage = estimate.stages[entry["pp_rank"]]
        entry["estimate_bytes"] = {part.name: part.bytes for part in stage.parts}
        entry["estimate_total_bytes"] = stage.total_bytes


def build_report(
    run: Run, cost: StepCost, times: dict[str, float], memory: dict[str, int], counts: StepCounts
) -> dict[str, Any]:
    """The report from this rank's mean step times, memory parts and counted step. Collective."""
    ps, cfg = run.ps, run.cfg
    coords = {"rank": ps.rank} | {name: ps.coord(name[:-5]) for name in COORDS[1:]}
    row = {**coords, **times, **{f"mem.{k}": v for k, v in memory.items()}}
    row.update(count_values(counts))
    ranks = [rank_entry(r, cost) for r in gather_ranks(run, row)]
    add_estimates(ranks, estimate_layout(cfg, ps.world_size, device=ps.device.type))
    layout = layout_of(cfg, ps.world_size)
    straggler = max(ranks, key=lambda r: r["step_time_s"])
    worst = straggler["step_time_s"]
    tflops = cost.flops / cost.devices / worst / 1e12
    peak = cost.peak_for(tflops * 1e12)
    compute = sum(r["time_s"]["forward"] + r["time_s"]["backward"] for r in ranks)
    traced = [r["traced_step_time_s"] for r in ranks if r["traced_step_time_s"] is not None]
    total = {
        "step_time_s": worst,
        "traced_step_time_s": max(traced, default=None),
        "straggler_rank": straggler["rank"],
        "tokens_per_sec": cost.tokens / worst,
        "tflops": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
        "bubble_measured": sum(r["time_s"]["bubble"] for r in ranks) / compute,
        "bubble_simulated": simulated_bubble(cfg, layout, ranks),
        "memory_total_bytes_max": max(r["memory_total_bytes"] for r in ranks),
        # MoE: the busiest expert's routed tokens over the mean, and pairs dropped (median step)
        "expert_imbalance": max(r["expert_imbalance"] for r in ranks) or None,
        "dropped_tokens": max(r["dropped_tokens"] for r in ranks)
        if cfg.model.moe_experts
        else None,
        # the counted step at the rank that launched most and synced most
        "launches_per_step": max(r["counts"]["launches"]["total"] for r in ranks),
        "host_syncs_per_step": max(r["counts"]["host_syncs"]["total"] for r in ranks),
        "recompiles": max(r["counts"]["recompiles"] for r in ranks),
    }
    return {
        "config": config_to_dict(cfg),
        "world_size": ps.world_size,
        "layout": layout,
        "device": str(ps.device.type),
        "devices": cost.devices,
        "peak_tflops_per_device": peak / 1e12 if peak else None,
        "tokens_per_step": cost.tokens,
        "total": total,
        "ranks": ranks,
        "counted_step": {
            "rank": ps.rank,
            "sync_sites": counts.sync_sites,
            "graph_breaks": counts.graph_breaks,
        },
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


SHOWN_OVERLAP = ("tp", "cp", "dp")
"""Overlapped communication in the table (the other axes' collectives are blocking)."""


def layout_line(report: dict[str, Any]) -> str:
    """`layout: tp=.. cp=.. pp=.. ...` of the profiled run."""
    x = report["layout"]
    cp = f"cp={x.get('cp', 1)}" + (f" ({x['cp_comm']})" if x.get("cp", 1) > 1 else "")
    ep = f" (ep={x['ep']})" if x.get("ep", 1) > 1 else ""
    return (
        f"layout: tp={x['tp']} {cp} pp={x['pp']} vpp={x['vpp']} dp={x['dp']}{ep} sp={x['sp']} "
        f"zero={x['zero']} schedule={x['schedule']} on {report['world_size']} ranks; "
        f"micro-batches: {x['microbatches']} of {x['micro_batch_size']}"
    )


def format_table(report: dict[str, Any]) -> str:
    """The layout, then the console table: one row per rank, then the total (rates at the
    slowest rank's step time, the largest memory), then the bubble measured against the
    simulator's. The cp columns only where there is context parallelism."""
    with_cp = report["layout"].get("cp", 1) > 1
    shown = {"cp": with_cp, "ep": report["layout"].get("ep", 1) > 1}
    parts = [p for p in TIME_PARTS if shown.get(p.removesuffix("_comm_exposed"), True)]
    overlaps = [axis for axis in SHOWN_OVERLAP if shown.get(axis, True)]
    names = [p.removesuffix("_comm_exposed") + (" exp" if "comm" in p else "") for p in parts]
    names += [f"{axis} ovl" for axis in overlaps]
    axes = ("tp", "cp", "pp", "dp") if with_cp else ("tp", "pp", "dp")
    coords_head = " ".join(f"{axis:>2}" for axis in axes)
    head = (
        f"{'rank':>4} {coords_head} {'step ms':>8} {'tok/s':>9} {'TFLOP/s':>8} "
        f"{'MFU':>6} | " + " ".join(f"{n[:9]:>9}" for n in names) + " | "
        f"{'mem MiB':>8} {'est MiB':>8}"
    )
    lines = [layout_line(report), head, "-" * len(head)]

    def row(label: str, coords: str, entry: dict[str, Any], parts: str, mem: str) -> str:
        mfu = "n/a" if entry["mfu"] is None else f"{entry['mfu']:.1%}"
        return (
            f"{label:>4} {coords} {entry['step_time_s'] * 1e3:8.1f} "
            f"{entry['tokens_per_sec']:9,.0f} {entry['tflops']:8.3f} {mfu:>6} | {parts} | {mem}"
        )

    for r in report["ranks"]:
        seconds = [r["time_s"][p] for p in parts]
        seconds += [r["comm_overlapped_s"][axis] for axis in overlaps]
        cells = " ".join(f"{s * 1e3:9.1f}" for s in seconds)
        coords = " ".join(f"{r[f'{axis}_rank']:>2}" for axis in axes)
        mem = f"{_mib(r['memory_total_bytes']):>8} {_mib(r['estimate_total_bytes']):>8}"
        lines.append(row(str(r["rank"]), coords, r, cells, mem))
    total = report["total"]
    blank = " ".join(f"{'':>9}" for _ in names)
    lines.append("-" * len(head))
    worst_memory = f"{_mib(total['memory_total_bytes_max']):>8}"
    lines.append(row("all", f"{'worst':^{len(coords_head)}}", total, blank, worst_memory))
    fastest = min(r["step_time_min_s"] for r in report["ranks"])
    slowest = max(r["step_time_max_s"] for r in report["ranks"])
    lines.append(
        f"(times in ms: each rank's median measured step and its parts, timed as `megalite "
        f"train` times a step, measured steps {fastest * 1e3:.1f} to {slowest * 1e3:.1f}; exp: "
        f"communication the rank waited for, ovl: in flight beside compute; total at the "
        f"slowest rank {total['straggler_rank']}) pipeline bubble (idle / compute): measured "
        f"{total['bubble_measured']:.3f}, simulated {total['bubble_simulated']:.3f}"
    )
    if total.get("expert_imbalance") is not None:
        lines.append(
            f"experts: the busiest routed {total['expert_imbalance']:.2f}x the mean (1.00: "
            f"balanced); {total['dropped_tokens']} (token, choice) pairs dropped over capacity"
        )
    lines += count_lines(report)
    if total["traced_step_time_s"] is not None:
        traced = total["traced_step_time_s"]
        lines.append(
            f"traced steps (--trace, torch.profiler on): {traced * 1e3:.1f} ms at the slowest "
            f"rank, {traced / total['step_time_s'] - 1:+.0%} over the measured steps; the "
            "profiler's own cost, timed apart and kept out of the rates above"
        )
    return "\n".join(lines)


PHASE_HEADS = ("fwd", "bwd", "opt", "other", "total")


def count_lines(report: dict[str, Any]) -> list[str]:
    """The counted step's table: per rank its launches (and of them the compiled kernels) and
    host syncs by phase, its compiled graphs, graph breaks and recompiles; then where this
    rank's syncs came from and why its graphs broke."""
    phases = " ".join(f"{h:>5}" for h in PHASE_HEADS)
    head = (
        f"{'rank':>4} | launches {phases} {'compiled':>8} | host syncs {phases} | "
        "graphs breaks recompiles"
    )
    lines = ["counted step (one more, after the measured ones; `launch_count` says what counts):"]
    lines += [head, "-" * len(head)]
    for r in report["ranks"]:
        c = r["counts"]
        cells = {
            what: " ".join(f"{c[what][p]:>5}" for p in (*PHASES, "total"))
            for what in ("launches", "host_syncs")
        }
        lines.append(
            f"{r['rank']:>4} | {'':8} {cells['launches']} {c['compiled_kernels']['total']:>8} | "
            f"{'':10} {cells['host_syncs']} | {c['compiled_graphs']:>6} {c['graph_breaks']:>6} "
            f"{c['recompiles']:>10}"
        )
    mine = report["counted_step"]
    sites = ", ".join(f"{n} {site}" for site, n in mine["sync_sites"].items()) or "none"
    lines.append(f"host syncs on rank {mine['rank']}: {sites}")
    for reason, n in mine["graph_breaks"].items():
        lines.append(f"graph break in rank {mine['rank']}'s process (x{n}): {reason}")
    return lines


def flat_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's numbers as `profile/...` scalars for wandb / TensorBoard."""
    flat = {f"profile/{k}": v for k, v in report["total"].items() if v is not None}
    for r in report["ranks"]:
        prefix = f"profile/rank{r['rank']}"
        for key in ("step_time_s", "tokens_per_sec", "tflops", "mfu", "bubble"):
            if r[key] is not None:
                flat[f"{prefix}/{key}"] = r[key]
        flat.update({f"{prefix}/time_s/{k}": v for k, v in r["time_s"].items()})
        overlapped = r["comm_overlapped_s"].items()
        flat.update({f"{prefix}/comm_overlapped_s/{k}": v for k, v in overlapped})
        flat.update({f"{prefix}/memory_bytes/{k}": v for k, v in r["memory_bytes"].items()})
        for what in ("launches", "host_syncs"):
            flat.update({f"{prefix}/{what}/{k}": v for k, v in r["counts"][what].items()})
    return {k: float(v) for k, v in flat.items() if math.isfinite(float(v))}


def publish(report: dict[str, Any], cfg: Config, out: Path) -> None:
    """Print the table, write the JSON report and log it to the trackers the config asks for."""
    print(format_table(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    for tracker in start_trackers(cfg, out.parent, new_tracker_id()):
        tracker.log(flat_metrics(report), step=0)
        tracker.close()
