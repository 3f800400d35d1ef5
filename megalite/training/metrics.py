"""Where metrics go: `<out_dir>/metrics.jsonl` (one JSON object per row), the console progress
bar, and Weights & Biases when asked for. Only rank 0 writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megalite.config import Config, config_to_dict


class MetricsLogger:
    def __init__(self, cfg: Config, out_dir: Path, enabled: bool, start_step: int) -> None:
        self.enabled = enabled
        self.bar = None
        self.wandb_run = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115  (closed in close())
        if cfg.logging.progress:
            self.bar = tqdm(
                total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True
            )
        if cfg.logging.wandb:
            self.wandb_run = _start_wandb(cfg, out_dir)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

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
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _start_wandb(cfg: Config, out_dir: Path):
    """Online with an API key, otherwise offline: never a crash or a hang for lack of network."""
    import wandb

    online = bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline"
    try:
        return wandb.init(
            project=cfg.logging.wandb_project,
            dir=str(out_dir),
            config=config_to_dict(cfg),
            mode="online" if online else "offline",
            settings=wandb.Settings(init_timeout=30),
        )
    except Exception as exc:  # a logging backend must never stop training
        print(f"wandb unavailable ({exc}); logging to metrics.jsonl only")
        return None
