"""A step's metrics row and where rows go: `<out_dir>/metrics.jsonl` (one JSON object per row),
the console progress bar, and the trackers asked for (Weights & Biases, TensorBoard: see
`trackers`). Only rank 0 writes.

Rows are strict JSON: a value that is not a finite number (MFU on a GPU without a known peak,
the gradient norm of a step skipped for fp16 overflow) is written as null, because `NaN` and
`Infinity` are not JSON and break the readers of the file."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megalite.config import Config
from megalite.optimizer.loss_scale import LossScaler
from megalite.parallel_state import ParallelState
from megalite.profiling.flops import flops_per_token, peak_flops
from megalite.training.step import StepMetrics
from megalite.training.trackers import Tracker, start_trackers


@dataclass(frozen=True)
class StepCost:
    """What one step processes, for the rates in its row."""

    tokens: int
    flops: float
    peak_flops: float
    """Of the whole world; NaN for a GPU without a known peak, so MFU is logged null."""

    @classmethod
    def of(cls, cfg: Config, ps: ParallelState) -> StepCost:
        tokens = cfg.train.global_batch_size * cfg.model.seq_len
        return cls(
            tokens, flops_per_token(cfg.model) * tokens, peak_flops(ps.device) * ps.world_size
        )


def metrics_row(
    step: int,
    metrics: StepMetrics,
    lr: float,
    elapsed_s: float,
    cost: StepCost,
    scaler: LossScaler,
) -> dict[str, float]:
    """The row of a finished step (`step` counts it), before evaluation adds its val loss."""
    return {
        "step": step,
        "loss": metrics.loss,
        "lr": lr,
        "grad_norm": metrics.grad_norm,
        "tokens_per_sec": cost.tokens / elapsed_s,
        "step_time_s": elapsed_s,
        "tflops": cost.flops / elapsed_s / 1e12,
        "mfu": cost.flops / elapsed_s / cost.peak_flops,
        "bubble_fraction": metrics.bubble_fraction,
        "skipped_steps": scaler.skipped_steps,
        "loss_scale": scaler.scale,
    }


class MetricsLogger:
    def __init__(
        self, cfg: Config, out_dir: Path, enabled: bool, start_step: int, tracker_id: str
    ) -> None:
        self.enabled = enabled
        self.bar = None
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115  (closed in close())
        if cfg.logging.progress:
            self.bar = tqdm(
                total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True
            )
        self.trackers = start_trackers(cfg, out_dir, tracker_id)

    def log(self, row: dict[str, Any]) -> None:
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
