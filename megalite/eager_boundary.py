"""Functions that torch.compile must not trace: a compiled region calls them as one opaque op
(a graph break) and they run eagerly, exactly as written. The tensor-parallel linears and the
sequence-parallel mappings are such functions (`train.compile`, training/compile.py): their
collectives, hand-scheduled overlap and observers stay as they are.

Why not `@torch.compiler.disable` where they are defined: that imports torch._dynamo, which
imports Triton, at import time, for every run, compiled or not (and before a test can set
TRITON_INTERPRET). `eager_only` marks a function; `mark_for_compile` (called when blocks are
compiled) makes each marked function dynamo's disabled version of itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_marked: list[Callable] = []
_disabled: dict[Callable, Callable] = {}
"""Each marked function -> its `torch.compiler.disable` version, once something compiles."""


def eager_only(fn: F) -> F:
    """`fn`, called eagerly even from inside a compiled region (see the module docstring)."""
    _marked.append(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return _disabled.get(fn, fn)(*args, **kwargs)

    return call  # type: ignore[return-value]


def mark_for_compile() -> None:
    """Make every marked function opaque to torch.compile from now on."""
    import torch

    for fn in _marked:
        if fn not in _disabled:
            _disabled[fn] = torch.compiler.disable(fn, recursive=True)
