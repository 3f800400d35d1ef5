"""Experiment trackers beside metrics.jsonl: Weights & Biases and TensorBoard. Each gets the
resolved config once and every metrics row; a tracker that cannot start says why and training
goes on without it (a logging backend must never stop a run).

Weights & Biases goes online with the usual login (WANDB_API_KEY, or the key `wandb login`
stores in ~/.netrc) and offline otherwise, saying so. Its run id lives in the checkpoint, so a
resumed run continues the same wandb run rather than starting a new one.
"""

from __future__ import annotations

import netrc
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

import yaml

from megalite.config import Config, config_to_dict

WANDB_HOST = "api.wandb.ai"


class Tracker(Protocol):
    def log(self, row: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def run_name(cfg: Config) -> str:
    """`logging.run_name`, or the run directory's name."""
    return cfg.logging.run_name or Path(cfg.train.out_dir).name


def new_tracker_id() -> str:
    """An id for a new run in the trackers (kept in the checkpoint for resumes)."""
    return uuid.uuid4().hex[:12]


def wandb_logged_in() -> bool:
    """An API key in the environment, or in ~/.netrc where `wandb login` puts it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(WANDB_HOST) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def start_trackers(cfg: Config, out_dir: Path, tracker_id: str) -> list[Tracker]:
    """The trackers the config asks for, started (those that fail to start are left out)."""
    trackers: list[Tracker | None] = []
    if cfg.logging.wandb:
        trackers.append(_start_wandb(cfg, out_dir, tracker_id))
    if cfg.logging.tensorboard:
        trackers.append(_start_tensorboard(cfg, out_dir))
    return [t for t in trackers if t is not None]


class _Wandb:
    def __init__(self, run) -> None:
        self.run = run

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()


def _start_wandb(cfg: Config, out_dir: Path, tracker_id: str) -> _Wandb | None:
    import wandb

    log = cfg.logging
    online = wandb_logged_in() and os.environ.get("WANDB_MODE") != "offline"
    if not online:
        print(
            f"wandb: no API key (WANDB_API_KEY or `wandb login`): logging offline under "
            f"{out_dir / 'wandb'}; `wandb sync` uploads it later"
        )
    try:
        run = wandb.init(
            project=log.wandb_project,
            entity=log.wandb_entity,
            group=log.wandb_group,
            tags=[t.strip() for t in log.wandb_tags.split(",") if t.strip()],
            name=run_name(cfg),
            id=tracker_id,
            resume="allow",  # the same id after a resume continues the same run
            dir=str(out_dir),
            config=config_to_dict(cfg),
            mode="online" if online else "offline",
            settings=wandb.Settings(init_timeout=30),
        )
    except Exception as exc:  # a logging backend must never stop training
        print(f"wandb unavailable ({exc}); logging to metrics.jsonl only")
        return None
    return _Wandb(run)


class _TensorBoard:
    def __init__(self, writer) -> None:
        self.writer = writer

    def log(self, row: dict[str, Any], step: int) -> None:
        for key, value in row.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _start_tensorboard(cfg: Config, out_dir: Path) -> _TensorBoard | None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        print(f"tensorboard unavailable ({exc}); pip install tensorboard")
        return None
    writer = SummaryWriter(log_dir=str(out_dir / "tensorboard" / run_name(cfg)))
    config = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    writer.add_text("config", "```\n" + config + "```")  # markdown: keep the YAML as it is
    return _TensorBoard(writer)
