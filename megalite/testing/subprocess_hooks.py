"""How a test gives a `megalite` subprocess (the CLI, torchrun's workers) the hooks of this
package: `environment(...)` names them in the variables the subprocess starts with, and
`tests/support/sitecustomize.py`, which Python imports at every start when `tests/support` is
on PYTHONPATH, hands them to `install_on_import`. The trainer reads no variable for them.

Each hook is installed once the module it hooks into has been imported, not at start-up: a
subprocess that never communicates (a config error, a data command) stays as light as outside
the tests, torch not loaded, and no module is imported earlier than the program imports it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _nccl_like(value: str) -> None:
    from megalite.testing import nccl_like

    nccl_like.install()


def _stall_save(value: str) -> None:
    from megalite.checkpoint import writer
    from megalite.testing.faults import stalling

    step, seconds = value.split(":")
    writer.first_file_written.append(stalling(int(step), float(seconds)))


HOOKS: dict[str, tuple[str, Callable[[str], None]]] = {
    "nccl_like": ("megalite.comm", _nccl_like),
    "stall_save": ("megalite.checkpoint.writer", _stall_save),
}
"""Each hook: the module it hooks into, and how it is installed (given its value)."""


def install_on_import(spec: str) -> None:
    """Install the hooks `spec` (HOOKS_ENV's value) names, each right after the module it hooks
    into is first imported (now, if it already is)."""
    for hook in filter(None, spec.split(",")):
        name, _, value = hook.partition("=")
        if name not in HOOKS:
            raise ValueError(f"{HOOKS_ENV}: unknown hook {name!r} ({', '.join(HOOKS)})")
        module, install = HOOKS[name]
        if module in sys.modules:
            install(value)
        else:
            sys.meta_path.insert(
                0, _AfterImport(module, lambda install=install, v=value: install(v))
            )


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds `module` as Python would, and runs `then` once the module has executed."""

    def __init__(self, module: str, then: Callable[[], None]) -> None:
        self.module, self.then = module, then

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.module:
            return None
        sys.meta_path.remove(self)  # the real finders now; and only once
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def execute_then(module: Any) -> None:
            execute(module)
            self.then()

        spec.loader.exec_module = execute_then
        return spec
