"""The registry of architectures, and what the configuration knows of each.

An architecture is one package under models/ (see models/gpt): its model, its Hugging Face
mapping, its closed-form formulas, and an `Architecture` record in its `__init__.py`. This
module lists the shipped packages by name (`SHIPPED`: one line per architecture) and imports
their records on first use; a plugin or a test registers one at run time (`register`). The
record is all that `megalite.config` reads (the MLP width default, whether grouped-query
attention and rope scaling are allowed), so a record imports nothing of megalite but this
module: a config is checked before torch is imported, and the rest of the package imports the
config. The other parts are named by import path and imported by whoever uses them (`load`).

Why the registry is not in models/: the config reads it, and models/ imports the config; here,
below both, the packages' import graph has no cycle (tests/unit/test_imports.py).
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
    any_head_dim: bool = False
    """Whether `model.head_dim` may differ from hidden / n_heads (q then n_heads * head_dim
    wide)."""
    tie_option: bool = False
    """Whether `model.tie_embeddings` may tie its LM head to the token embedding."""
    sliding_window: bool = False
    """Whether `model.sliding_window` (and its layer pattern) may be set: the model's attention
    takes a window."""
    query_scale: bool = False
    """Whether `model.query_scale` may set the softmax scale (query_scale ** -0.5 in place of
    head_dim ** -0.5)."""
    layer_rope: bool = False
    """Whether the windowed layers may take a rotary base of their own (`model.rope_local_theta`)
    and the others a linear scaling (`model.rope_linear_factor`)."""
    rope_scaling: bool = False
    """Whether `model.rope_scaling` may be set: the model has rotary embeddings from
    `layers.rotary_tables`, and its Hugging Face mapping carries the scaling both ways."""
    mixture_of_experts: bool = False
    """Whether its MLPs are mixtures of experts: the `model.moe_*` settings apply (and
    `model.moe_experts` must be set), and `model.ffn_hidden` is each expert's width."""


SHIPPED = (
    "megalite.models.gpt",
    "megalite.models.llama",
    "megalite.models.mixtral",
    "megalite.models.mistral",
    "megalite.models.gemma3",
    "megalite.models.qwen2",
    "megalite.models.qwen3",
    "megalite.models.qwen3_moe",
)
"""The packages of the shipped architectures, each with its `ARCHITECTURE` record."""

_registered: dict[str, Architecture] = {}


def _registry() -> dict[str, Architecture]:
    if not _registered:
        for package in SHIPPED:
            record = importlib.import_module(package).ARCHITECTURE
            _registered[record.name] = record
    return _registered


def register(arch: Architecture) -> None:
    """Make `arch` buildable as `model.arch=<arch.name>`."""
    if arch.name in _registry():
        raise ValueError(f"an architecture named {arch.name!r} is already registered")
    _registered[arch.name] = arch


def unregister(name: str) -> None:
    """Forget the architecture `name` (a test's own, once it is done)."""
    del _registry()[name]


def names() -> list[str]:
    """The registered architectures' names, in registration order."""
    return list(_registry())


def architecture(name: str) -> Architecture:
    """The registered architecture called `name` (`names()` lists them)."""
    return _registry()[name]


def load(path: str) -> Any:
    """The object a "package.module:name" path names, its module imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
