"""An architecture's weights and config as Hugging Face's: the interface each architecture's
`hf.py` implements (`HFMapping`). `megalite.checkpoint.hf` does the rest (files, vocabulary
padding, the checks that name the overrides to set) the same way for every architecture.

Tensors here are global megalite tensors by name (real vocabulary rows; a fused parameter by its
parts, `attn.wq.weight` ... as `tensor_parallel.global_tensors` gives them), so any tp / pp
layout converts the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megalite.architectures import architecture, load
from megalite.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Link:
    """Megalite tensor `ours` is (part `part` of `parts` along dim 0 of) Hugging Face tensor
    `theirs`, stored transposed when `transposed` (GPT-2's Conv1D)."""

    ours: str
    theirs: str
    transposed: bool = False
    part: int = 0
    parts: int = 1


class HFMapping(ABC):
    """How one architecture reads and writes a Hugging Face model: a name table (`links`) that
    serves both directions, and its config translated both ways."""

    model_type: str
    """The `model_type` of the Hugging Face config it maps to (config.json)."""
    base_prefix: str
    """Where the base model's weights sit ("transformer."): checkpoints saved from the base
    class (not the causal LM) name them without it."""

    @abstractmethod
    def links(self, m: ModelConfig) -> list[Link]:
        """The name map between megalite and Hugging Face."""

    @abstractmethod
    def hf_config(self, m: ModelConfig) -> PretrainedConfig:
        """The Hugging Face config of these dimensions (`AutoModelForCausalLM.from_config`
        builds the model)."""

    @abstractmethod
    def config_from_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The megalite model settings (`ModelConfig` fields, `max_positions` among them, and
        the rotary settings where the architecture has them) that a Hugging Face config.json
        describes, with the defaults of releases that omit them; ValueError for what megalite
        does not implement. `checkpoint.init_from` adopts those in
        `checkpoint.initial.ADOPTED` and checks the rest against the config."""

    def aliases(self, raw: dict[str, Any]) -> dict[str, str]:
        """Hugging Face tensors a checkpoint may leave out because they equal another one it
        stores (a tied head), by the name of that one."""
        return {}

    def to_hf(self, params: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
        """Megalite tensors -> a Hugging Face state dict."""
        parts: dict[str, list[torch.Tensor]] = {}
        transposed: dict[str, bool] = {}
        for link in self.links(m):  # parts of a fused tensor come in order
            parts.setdefault(link.theirs, []).append(params[link.ours])
            transposed[link.theirs] = link.transposed
        state = {}
        for name, pieces in parts.items():
            full = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            state[name] = full.t() if transposed[name] else full
        return state

    def for_model(
        self, state: dict[str, torch.Tensor], keys: Collection[str], m: ModelConfig
    ) -> dict[str, torch.Tensor]:
        """`to_hf`'s state dict (the layout of the published checkpoints) as the installed
        transformers' model class names its tensors in memory (`keys`), where the two differ;
        `save_pretrained` writes the published layout again."""
        return state

    def from_hf(
        self, state: dict[str, torch.Tensor], m: ModelConfig, names: Collection[str] | None
    ) -> dict[str, torch.Tensor]:
        """A Hugging Face state dict (every tensor `links` needs) -> megalite tensors: all of
        them, or those in `names`."""
        params = {}
        for link in self.links(m):
            if names is not None and link.ours not in names:
                continue
            full = state[link.theirs]
            full = full.t() if link.transposed else full
            params[link.ours] = full.chunk(link.parts)[link.part] if link.parts > 1 else full
        return params


def hf_mapping(arch: str) -> HFMapping:
    """The Hugging Face mapping of the registered architecture `arch`."""
    return load(architecture(arch).hf)
