"""What the configuration knows of an architecture, and where the rest of it lives.

An architecture is one package under models/ (see models/gpt): its model, its Hugging Face
mapping, its closed-form formulas, and an `Architecture` record in its `__init__.py` that
`models.registry` lists. The record is all that `megalite.config` reads (the MLP width default,
whether grouped-query attention is allowed), so it imports nothing of megalite: a config is
checked before torch is imported, and the rest of the package imports the config. The other
parts are named by import path and imported by whoever uses them (`load`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """One architecture as the registry lists it."""

    name: str
    """Its `model.arch`."""
    default_ffn_hidden: Callable[[int], int]
    """The MLP's inner width for a model width, when `model.ffn_hidden` is not set."""
    model: str
    """Its `CausalLM` subclass, as "package.module:name" (see `load`)."""
    hf: str
    """Its `HFMapping` (`models.hugging_face`): its weights and config as Hugging Face's."""
    formulas: str
    """Its `Formulas` (`models.formulas`): parameters, FLOPs and activations in closed form."""
    grouped_query: bool = False
    """Whether `model.n_kv_heads` may be fewer than `model.n_heads`."""


def load(path: str) -> Any:
    """The object a "package.module:name" path names, its module imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
