"""A step's metrics row and where rows go: `<out_dir>/metrics.jsonl` (one JSON object per row),
the console progress bar, and the trackers asked for (Weights & Biases, TensorBoard: see
`trackers`). Only rank 0 writes.

Rows are strict JSON: a value that is unknown or not a finite number (MFU on a GPU without a
known peak, the gradient norm of a step skipped for fp16 overflow) is written as null, because
`NaN` and `Infinity` are not JSON and break the readers of the file."""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from megalite import comm
from megalite.config import Config
from megalite.hardware import host_id, peak_flops, raise_cpu_peak_flops, unknown_peak_message
from megalite.models.flops import flops_per_token
from megalite.parallel_state import ParallelState
from megalite.training.setup import resolve_precision
from megalite.training.step import StepMetrics
from megalite.training.trackers import Tracker, start_trackers


@dataclass
class StepCost:
    """What one step processes, for the rates in its row."""

    tokens: int
    flops: float
    """Model FLOPs of one step of the whole world (causal attention halved, no recompute)."""
    devices: int
    """The devices the world's work runs on: its GPUs, or on CPU its machines (the ranks on a
    machine share its cores, so the machine is the device)."""
    device_peak_flops: float | None
    """Dense peak FLOP/s of one device; None when unknown (a GPU missing from the table), so
    that MFU is logged as null."""
    measured_precision: str | None = None
    """Set when the peak is this CPU's measured one (not a datasheet's or the user's): a step
    that beats it raises it (`peak_for`)."""

    def peak_for(self, achieved: float) -> float | None:
        """The device peak to divide `achieved` FLOP/s by. A measured CPU peak that a step beats
        was taken while the machine was busy: it rises to what the step achieved, here and in
        the machine's cache, so MFU stays at most 1."""
        peak = self.device_peak_flops
        if peak is not None and achieved > peak and self.measured_precision is not None:
            raise_cpu_peak_flops(self.measured_precision, achieved)
            self.device_peak_flops = peak = achieved
        return peak

    @classmethod
    def of(cls, cfg: Config, ps: ParallelState) -> StepCost:
        """The step's cost on this layout. Collective on CPU (the ranks count their machines);
        rank 0 says once when a GPU's peak is unknown."""
        tokens = cfg.train.global_batch_size * cfg.model.seq_len
        if ps.device.type == "cuda":
            devices = ps.world_size
        else:
            devices = count_hosts(ps.world_group)
        precision = resolve_precision(cfg.train.precision, ps.device)
        measured = None
        if cfg.logging.peak_tflops is not None:
            peak = cfg.logging.peak_tflops * 1e12
        else:
            peak = peak_flops(ps.device, precision)
            if peak is None and ps.rank == 0:
                print(unknown_peak_message(ps.device))
            measured = precision if ps.device.type == "cpu" else None
        if cfg.train.fp8 != "none" and ps.rank == 0:
            print(float8_peak_note(cfg.train.fp8, precision))
        return cls(tokens, flops_per_token(cfg.model) * tokens, devices, peak, measured)


def count_hosts(group: Any) -> int:
    """How many machines the ranks of `group` run on. Collective."""
    here = torch.tensor([[host_id()]], dtype=torch.int64)
    return len(set(comm.all_gather(here, group, dim=0).flatten().tolist()))


def metrics_row(
    step: int,
    metrics: StepMetrics,
    lr: float,
    elapsed_s: float,
    cost: StepCost,
) -> dict[str, float | None]:
    """The row of a finished step (`step` counts it), before evaluation adds its val loss.
    `tflops` is achieved model TFLOP/s per device and `mfu` that over the device's peak."""
    per_device = cost.flops / elapsed_s / cost.devices
    peak = cost.peak_for(per_device)
    row = {
        "step": step,
        "loss": metrics.loss,
        "lr": lr,
        "grad_norm": metrics.grad_norm,
        "tokens_per_sec": cost.tokens / elapsed_s,
        "step_time_s": elapsed_s,
        "tflops": per_device / 1e12,
        "mfu": None if peak is None else per_device / peak,
        "bubble_fraction": metrics.bubble_fraction,
        "skipped_steps": metrics.skipped_steps,
        "loss_scale": metrics.loss_scale,
    }
    if metrics.compile_s is not None:
        row |= {"compile_s": metrics.compile_s, "recompiles": metrics.recompiles}
    if metrics.expert_imbalance is not None:
        row |= {"expert_imbalance": metrics.expert_imbalance}
        row |= {"dropped_tokens": metrics.dropped_tokens}
    return row


def float8_peak_note(recipe: str, precision: str) -> str:
    """What an fp8 run's MFU is measured against: the compute dtype's dense peak, as
    Megatron and torchtitan report it, not float8's (twice bf16's on an H100)."""
    return (
        f"train.fp8={recipe}: MFU is against the {precision} dense peak, not float8's "
        "(twice bf16's on H100 and H200)"
    )


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak-memory window (GPU; a CPU's peak resident set cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, int]:
    """This rank's peak memory: on GPU what the caching allocator handed out and held since
    the step began; on CPU the process's peak resident set since it started."""
    if device.type == "cuda":
        return {
            "peak_mem_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    kib = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib}


def rank_spread(step_time_s: float, ps: ParallelState) -> dict[str, float]:
    """The straggler and the worst memory over all ranks: the slowest rank's step time, which
    rank it was, the median step time, and the largest peak memory of any rank. One small
    all-gather over the world."""
    memory = peak_memory(ps.device)
    mine = torch.tensor([[step_time_s, *memory.values()]], dtype=torch.float64, device=ps.device)
    everyone = comm.all_gather(mine, ps.world_group, dim=0).cpu()  # (ranks, 1 + len(memory))
    times = everyone[:, 0].tolist()
    worst = everyone[:, 1:].max(dim=0).values.tolist()
    return {
        "step_time_max_s": max(times),
        "step_time_median_s": statistics.median(times),
        "slowest_rank": times.index(max(times)),
        **{name: int(value) for name, value in zip(memory, worst, strict=True)},
    }


class MetricsLogger:
    """Writes the rows (rank 0, `enabled`). With `ps`, every rank calls `log` for each row,
    which then gains the straggler and worst-memory figures of all ranks (`rank_spread`)."""

    def __init__(
        self,
        cfg: Config,
        out_dir: Path,
        enabled: bool,
        start_step: int,
        tracker_id: str,
        ps: ParallelState | None = None,
    ) -> None:
        self.enabled, self.ps = enabled, ps
        self.bar = None
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        drop_rows_after(out_dir / "metrics.jsonl", start_step)  # the steps this run replays
        self.file = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115  (closed in close())
        if cfg.logging.progress:
            self.bar = tqdm(
                total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True
            )
        self.trackers = start_trackers(cfg, out_dir, tracker_id)

    def log(self, row: dict[str, Any]) -> None:
        """Write `row` (rank 0); with `ps`, collective: add the figures of all ranks to it."""
        if self.ps is not None:
            row.update(rank_spread(row["step_time_s"], self.ps))
        if not self.enabled:
            return
        row = {k: None if _not_finite(v) else v for k, v in row.items()}
        self.file.write(json.dumps(row, allow_nan=False) + "\n")
        self.file.flush()
        logged = {k: v for k, v in row.items() if k != "step" and v is not None}
        for tracker in self.trackers:
            tracker.log(logged, step=row["step"])

    def progress(self, step: int, postfix: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(postfix, refresh=True)

    def write(self, message: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(message)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        for tracker in self.trackers:
            tracker.close()


def drop_rows_after(path: Path, step: int) -> None:
    """Remove the rows of steps after `step` from a metrics file: a run resumed from the
    checkpoint of `step` trains those steps again and logs them anew, so the file keeps one row
    per step. The file is replaced atomically; a missing file is left missing."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _row_step(line) <= step]
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _row_step(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return math.inf  # a row torn by a crash: dropped


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def summary_line(
    step: int,
    steps_run: int,
    loss: float,
    val_loss: float | None,
    tokens_per_sec: float,
    checkpoint: Path,
) -> str:
    """The one line every finished run ends with: where it got, how well, how fast, and
    where its weights are."""
    plural = "" if steps_run == 1 else "s"
    line = f"trained to step {step} ({steps_run} step{plural} in this run): loss {loss:.4f}"
    if val_loss is not None:
        line += f", val_loss {val_loss:.4f} (ppl {math.exp(min(val_loss, 50.0)):.1f})"
    return line + f", {tokens_per_sec:,.0f} tokens/s; checkpoint {checkpoint}"
