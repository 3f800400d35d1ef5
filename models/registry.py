"""The one list of architectures. `megalite.config` checks `model.arch` against it and takes an
architecture's defaults from it; the model factory, the Hugging Face conversion and the profiler
find the architecture's parts through it. A new architecture is a package under models/ (see
models/gpt) and one `register` line here; a plugin or a test may register one at run time."""

from __future__ import annotations

from megalite.models import gpt, llama
from megalite.models.architecture import Architecture

ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> None:
    """Make `arch` buildable as `model.arch=<arch.name>`."""
    if arch.name in ARCHITECTURES:
        raise ValueError(f"an architecture named {arch.name!r} is already registered")
    ARCHITECTURES[arch.name] = arch


register(gpt.ARCHITECTURE)
register(llama.ARCHITECTURE)


def names() -> list[str]:
    """The registered architectures' names, in registration order."""
    return list(ARCHITECTURES)


def architecture(name: str) -> Architecture:
    """The registered architecture called `name` (`names()` lists them)."""
    return ARCHITECTURES[name]
