"""How a test gives a `megalite` subprocess (the CLI, torchrun's workers) the hooks of this
package: `environment(...)` names them in the variables the subprocess starts with, and
`tests/support/sitecustomize.py`, which Python imports at every start when `tests/support` is
on PYTHONPATH, installs them before megalite runs. The trainer reads no variable for them."""

from __future__ import annotations

import os
from pathlib import Path

HOOKS_ENV = "MEGALITE_TEST_HOOKS"
"""Comma-separated hooks: `nccl_like`, `stall_save=<step>:<seconds>`."""
SUPPORT_DIR = Path(__file__).resolve().parents[2] / "tests" / "support"
"""Where `sitecustomize.py` lies (in the source tree: the tests run from it)."""


def environment(nccl_like: bool = True, stall_save: tuple[int, float] | None = None) -> dict:
    """The variables (to add to os.environ) that make a subprocess install these hooks."""
    hooks = ["nccl_like"] if nccl_like else []
    if stall_save is not None:
        hooks.append(f"stall_save={stall_save[0]}:{stall_save[1]}")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([str(SUPPORT_DIR), *(p for p in paths if p != str(SUPPORT_DIR))])
    return {HOOKS_ENV: ",".join(hooks), "PYTHONPATH": path}


def install(spec: str) -> None:
    """Install the hooks `spec` (HOOKS_ENV's value) names, for the rest of this process."""
    for hook in filter(None, spec.split(",")):
        name, _, value = hook.partition("=")
        if name == "nccl_like":
            from megalite.testing import nccl_like

            nccl_like.install()
        elif name == "stall_save":
            from megalite.checkpoint import writer
            from megalite.testing.faults import stalling

            step, seconds = value.split(":")
            writer.first_file_written.append(stalling(int(step), float(seconds)))
        else:
            raise ValueError(f"{HOOKS_ENV}: unknown hook {name!r} (nccl_like, stall_save)")
