"""`checkpoint.init_from`: the weights a fresh run starts from instead of random ones, taken
from a megalite checkpoint or a Hugging Face model directory. Only the weights: the optimizer,
the schedule and the data order start anew (fine-tuning), unlike `checkpoint.resume`.

The model's own position count and rotary settings (`ADOPTED`) come with its weights unless the
config sets them (`adopt_model_settings`); every other model setting must match the config, and
the error names the overrides that would make it so."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megalite.checkpoint.hf import (
    check_hf_config,
    hf_model_settings,
    mismatches,
    overrides,
    read_hf,
    read_hf_config,
)
from megalite.checkpoint.reader import local_piece
from megalite.checkpoint.sharded import (
    MODEL_IDENTITY,
    Checkpoint,
    CheckpointError,
    resolve_checkpoint,
)
from megalite.config import ROPE_SCALING_KEYS, Config, ModelConfig, build_config, with_values
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import global_tensors

ADOPTED = ("max_positions", "rope_theta", "rope_scaling", *ROPE_SCALING_KEYS)
"""The model settings a run takes from the model it starts from, unless its config sets them:
what the weights were trained for (their positions, their rotary frequencies), rather than a
choice of the run (the run's context is `model.seq_len`)."""


def check_saved_model(path: Path, saved: dict, model: ModelConfig) -> None:
    """The megalite checkpoint must hold the model the config builds; the error lists the
    overrides that would make it so (as for a Hugging Face model)."""
    theirs = build_config({"model": saved}).model
    wanted = mismatches({key: getattr(theirs, key) for key in MODEL_IDENTITY}, model)
    if wanted:
        raise CheckpointError(
            f"the megalite checkpoint {path} does not match the config: set {overrides(wanted)}"
        )


def initial_source(path: Path) -> Path:
    """The directory `checkpoint.init_from` names: a Hugging Face model directory, or a megalite
    checkpoint, which may be named as `--checkpoint` names one (a run directory, its
    `checkpoints/` or `latest`: the newest good checkpoint there)."""
    path = Path(path)
    if (path / "config.json").is_file() or not path.exists():
        return path  # `_kind` refuses what is not there
    try:
        return resolve_checkpoint(path)
    except CheckpointError as error:
        raise CheckpointError(
            f"checkpoint.init_from={path}: neither a Hugging Face model directory (no "
            f"config.json) nor a megalite run or checkpoint: {error}"
        ) from None


def _kind(path: Path) -> str:
    """`megalite` or `hf`, by the files in `path`; refused when it is neither."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.init_from={path}: no such directory")
    if (path / "manifest.json").is_file():
        return "megalite"
    if (path / "config.json").is_file():
        return "hf"
    raise CheckpointError(
        f"checkpoint.init_from={path}: neither a megalite checkpoint (no manifest.json) nor "
        "a Hugging Face model directory (no config.json)"
    )


def model_settings(path: Path) -> dict[str, Any]:
    """The `ModelConfig` settings (`arch` among them) of the model a megalite checkpoint or a
    Hugging Face model directory holds: what its config file says, no weight read."""
    if _kind(path) == "megalite":
        saved = Checkpoint(path, verify_files=False).config.get("model", {})
        return dataclasses.asdict(build_config({"model": saved}).model)
    arch, values = hf_model_settings(read_hf_config(path), path)
    return {"arch": arch, **values}


def adopt_model_settings(cfg: Config, source: Path) -> tuple[Config, dict[str, Any]]:
    """`cfg` with the `ADOPTED` settings of the model in `source` (what `checkpoint.init_from`
    names, or the checkpoint a run that started from it resumes) where the config does not set
    them (`Config.explicit`), and those it adopted. A model of another architecture adopts
    nothing (loading it names every override), nor a position count below `model.seq_len`
    (loading names the seq_len to lower to)."""
    theirs = model_settings(source)
    m = cfg.model
    if theirs["arch"] != m.arch:
        return cfg, {}
    adopted = {
        key: theirs[key]
        for key in ADOPTED
        if key in theirs and f"model.{key}" not in cfg.explicit and theirs[key] != getattr(m, key)
    }
    if adopted.get("rope_scaling", m.rope_scaling) != theirs.get("rope_scaling", "none"):
        for key in ROPE_SCALING_KEYS:  # another kind of scaling was chosen: its own parameters
            adopted.pop(key, None)
    if adopted.get("max_positions", m.seq_len) < m.seq_len:
        del adopted["max_positions"]
    if not adopted:
        return cfg, {}
    new = dataclasses.replace(cfg, model=dataclasses.replace(m, **adopted))
    new.explicit = cfg.explicit
    return new, adopted


def check_model(path: Path, m: ModelConfig) -> None:
    """The model in `path` (megalite or Hugging Face) is the one `m` builds, judged by its config
    file alone (the load checks again); the error names the overrides."""
    if _kind(path) == "megalite":
        check_saved_model(path, Checkpoint(path, verify_files=False).config.get("model", {}), m)
    else:
        check_hf_config(read_hf_config(path), path, m)


def init_from_settings(cfg: Config, resume_from: Path | None) -> tuple[Config, dict[str, Any]]:
    """The config a run with `checkpoint.init_from` builds its model from, and what it adopted
    (`adopt_model_settings`): from the init_from model, checked now, before any data is read;
    on a resume, from the checkpoint it resumes, which holds what the first run adopted (the
    resume compares the rest), so that the init_from directory need not still exist."""
    if not cfg.checkpoint.init_from:
        return cfg, {}
    if resume_from is not None:
        return adopt_model_settings(cfg, resume_from)
    path = initial_source(Path(cfg.checkpoint.init_from))
    if str(path) != cfg.checkpoint.init_from:  # the run's config names what it loads
        cfg = with_values(cfg, {"checkpoint.init_from": str(path)})
    cfg, adopted = adopt_model_settings(cfg, path)
    check_model(path, cfg.model)
    return cfg, adopted


def adoption_line(adopted: dict[str, Any]) -> str:
    """The line that tells a run what it took from the model it starts from."""
    settings = ", ".join(f"{key}={value}" for key, value in adopted.items())
    keys = ", ".join(f"model.{key}" for key in adopted)
    return f"init_from: adopting the model's {settings} (set {keys} to override)"


@torch.no_grad()
def load_initial_weights(
    path: Path,
    params: dict[str, nn.Parameter],
    routing: dict[str, torch.Tensor],
    ps: ParallelState,
    model: ModelConfig,
) -> None:
    """Fill this rank's parameters (global name -> local piece) from `path`, and from a megalite
    checkpoint the MoE routers' balancing biases (`routing`, which steer its routing as the
    weights do; Hugging Face Mixtral has none)."""
    if _kind(path) == "megalite":
        saved = Checkpoint(path)
        check_saved_model(path, saved.config["model"], model)
        saved.load_parameters(params, ps)
        saved.load_routing(routing)
    else:
        pieces = global_tensors(params)  # a fused parameter by parts, as HF stores them
        sources = {name: piece.meta.tied_name or name for name, piece in pieces.items()}
        tensors = read_hf(path, model, set(sources.values()))  # only what this rank holds
        for name, piece in pieces.items():
            piece.copy_(local_piece(tensors[sources[name]], sources[name], piece, ps))
