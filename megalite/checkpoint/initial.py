"""`checkpoint.init_from`: the weights a fresh run starts from instead of random ones, taken
from a megalite checkpoint or a Hugging Face model directory. Only the weights: the optimizer,
the schedule and the data order start anew (fine-tuning), unlike `checkpoint.resume`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from megalite.checkpoint.hf import read_hf
from megalite.checkpoint.sharded import CheckpointError, load_parameters, local_piece, read_manifest
from megalite.config import ModelConfig
from megalite.parallel_state import ParallelState


@torch.no_grad()
def load_initial_weights(
    path: Path, params: dict[str, nn.Parameter], ps: ParallelState, model: ModelConfig
) -> None:
    """Fill this rank's parameters (global name -> local piece) from `path`."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.init_from={path}: no such directory")
    if (path / "manifest.json").is_file():
        load_parameters(path, read_manifest(path), params, ps)
    elif (path / "config.json").is_file():
        sources = {name: param.meta.tied_name or name for name, param in params.items()}
        tensors = read_hf(path, model, set(sources.values()))  # only what this rank holds
        for name, param in params.items():
            param.copy_(local_piece(tensors[sources[name]], sources[name], param, ps))
    else:
        raise CheckpointError(
            f"checkpoint.init_from={path}: neither a megalite checkpoint (no manifest.json) nor "
            "a Hugging Face model directory (no config.json)"
        )
