"""Imports flow one way (models <- checkpoint <- training <- cli): no module of megalite imports,
even from inside a function, a module that imports it back, and reading or writing a Hugging
Face checkpoint does not pull in the trainer."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

# megalite.models and megalite.kernels live in the top-level folders models/ and kernels/.
PACKAGES = ("megalite", "megalite.models", "megalite.kernels")


def _module_files() -> dict[str, Path]:
    """Every megalite module name -> its source file, found without importing it."""
    files: dict[str, Path] = {}
    for package in PACKAGES:
        (root,) = importlib.util.find_spec(package).submodule_search_locations
        for path in Path(root).rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The megalite modules `module` imports anywhere in its file (function-level and
    TYPE_CHECKING imports included): `from a import b` counts as a.b if that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # longest prefix that is a module
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = _module_files()
    return {module: _imported(module, path, set(files)) for module, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(module: str) -> list[str] | None:
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target in on_stack:
                return stack[stack.index(target) :] + [target]
            if target not in done and (cycle := visit(target)):
                return cycle
        stack.pop()
        on_stack.remove(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return None


def package_of(module: str, packages: set[str]) -> str:
    """The folder a module's file is in (its package), except that each module directly in
    megalite/ is a node of its own: those are the small single-owner modules (config, comm,
    parallel_state, ...) that the packages layer on."""
    if module in packages and module != "megalite":
        return module
    parent = module.rpartition(".")[0]
    return module if parent == "megalite" or module == "megalite" else parent


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between packages (folders): an edge wherever a module of one imports a
    module of another."""
    packages = {module for module, path in _module_files().items() if path.name == "__init__.py"}
    condensed: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module, packages)
        edges = condensed.setdefault(source, set())
        edges |= {package_of(t, packages) for t in targets} - {source}
    return condensed


def test_no_import_cycle_between_packages():
    """Packages layer one way too (e.g. the pipeline never imports the profiler that times
    it): a cycle through folders is a role in the wrong place even when no two files cycle."""
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_the_package_graph_condenses_folders():
    graph = package_graph(import_graph())
    assert "megalite.config" in graph["megalite.models.gpt"]  # model.py, in models/gpt/
    assert "megalite.pipeline" in graph["megalite.training"]
    assert "megalite.training" not in graph["megalite.pipeline"]


def test_the_graph_sees_the_models_and_function_level_imports():
    graph = import_graph()
    assert "megalite.architectures" in graph["megalite.models.gpt"]
    assert "megalite.training.loop" in graph["megalite.cli"]  # imported inside a function
    assert "megalite.kernels.dispatch" in graph["megalite.kernels"]  # relative import


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_names_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_hugging_face_conversion_imports_no_training_module():
    code = (
        "import sys, megalite.checkpoint.hf, megalite.checkpoint.initial\n"
        "print(sorted(m for m in sys.modules if m.startswith('megalite.training')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_trainer_module_imports_the_test_hooks():
    """`megalite.testing` (the NCCL emulation, injected faults) is what tests inject: the
    trainer neither imports it nor reads a variable to switch it on."""
    graph = import_graph()
    importers = sorted(
        module
        for module, targets in graph.items()
        if not module.startswith("megalite.testing")
        and any(t.startswith("megalite.testing") for t in targets)
    )
    assert importers == []
