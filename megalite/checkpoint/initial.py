"""`checkpoint.init_from`: the weights a fresh run starts from instead of random ones, taken
from a megalite checkpoint or a Hugging Face model directory. Only the weights: the optimizer,
the schedule and the data order start anew (fine-tuning), unlike `checkpoint.resume`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from megalite.checkpoint.hf import read_hf
from megalite.checkpoint.reader import local_piece
from megalite.checkpoint.sharded import SHAPE_KEYS, Checkpoint, CheckpointError
from megalite.config import ModelConfig, build_config
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import global_tensors


def check_saved_model(path: Path, saved: dict, model: ModelConfig) -> None:
    """The megalite checkpoint must hold the model the config builds; the error lists the
    overrides that would make it so (as for a Hugging Face model)."""
    theirs = build_config({"model": saved}).model
    wanted = {
        f"model.{key}": getattr(theirs, key)
        for key in SHAPE_KEYS
        if getattr(theirs, key) != getattr(model, key)
    }
    if theirs.max_positions < model.seq_len:  # a longer context than it has positions for
        wanted["model.seq_len"] = theirs.max_positions
    if wanted:
        fix = " ".join(f"{key}={value}" for key, value in wanted.items())
        raise CheckpointError(
            f"the megalite checkpoint {path} does not match the config: set {fix}"
        )


@torch.no_grad()
def load_initial_weights(
    path: Path, params: dict[str, nn.Parameter], ps: ParallelState, model: ModelConfig
) -> None:
    """Fill this rank's parameters (global name -> local piece) from `path`."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.init_from={path}: no such directory")
    if (path / "manifest.json").is_file():
        saved = Checkpoint(path)
        check_saved_model(path, saved.config["model"], model)
        saved.load_parameters(params, ps)
    elif (path / "config.json").is_file():
        pieces = global_tensors(params)  # a fused parameter by parts, as HF stores them
        sources = {name: piece.meta.tied_name or name for name, piece in pieces.items()}
        tensors = read_hf(path, model, set(sources.values()))  # only what this rank holds
        for name, piece in pieces.items():
            piece.copy_(local_piece(tensors[sources[name]], sources[name], piece, ps))
    else:
        raise CheckpointError(
            f"checkpoint.init_from={path}: neither a megalite checkpoint (no manifest.json) nor "
            "a Hugging Face model directory (no config.json)"
        )
