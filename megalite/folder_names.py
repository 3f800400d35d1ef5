"""The top-level folder `kernels/` ships as `megalite.kernels`, but from a checkout's root (`python
-m megalite`, `torchrun -m megalite`, `python -m pytest`) the working directory is on sys.path,
so `import kernels` finds the folder under its bare name too. Something does import that name:
transformers probes for Hugging Face's `kernels` package by importing it. The folder would then
run a second time as another package, with its own copy of every kernel, and re-register the
`megalite::` operators to that copy; with Hugging Face's `kernels` installed, it would also hide
it from transformers. `give_way` makes the bare name harmless.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path


def give_way(bare_name: str, package_file: str, canonical: str) -> None:
    """Called by a top-level folder's `__init__` when it is imported as `bare_name` instead of
    `canonical`: the name goes to an installed package of that name found further along
    sys.path, or else to `canonical` itself, so no module of the folder runs twice; from a
    checkout where megalite is not installed there is nothing to give, and an empty module (no
    file, no version: what transformers takes for an empty namespace package) says so. The
    import that got here then returns what `sys.modules[bare_name]` holds."""
    root = Path(package_file).resolve().parent.parent  # the sys.path entry that exposed it
    elsewhere = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec(bare_name, elsewhere)
    if spec is None or spec.loader is None:
        if importlib.util.find_spec(canonical) is None:
            sys.modules[bare_name] = types.ModuleType(bare_name)
        else:
            sys.modules[bare_name] = importlib.import_module(canonical)
        return
    installed = importlib.util.module_from_spec(spec)
    sys.modules[bare_name] = installed
    spec.loader.exec_module(installed)
