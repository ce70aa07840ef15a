"""The package's shape, read from its source: no import cycles inside verispec/ (imports inside functions and under
TYPE_CHECKING included), and the two lowest layers (DESIGN.md) import only from themselves and below: kernels/ knows
nothing of models, models/ nothing of sampling, drafters or anything else above it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "verispec"
# What each of the lowest layers may import (DESIGN.md), besides itself: everything else is above it. Named as what
# is allowed, not what is forbidden, so that a module added above (or one forgotten, as sampling was) is caught too.
BELOW = {"kernels": (), "models": ("kernels", "errors", "checkpoints")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(name: str) -> str:
    """The verispec module an import of `name` loads: itself, or the package or module that holds the name."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str) -> set[str]:
    """Every verispec module that `module` imports anywhere in its source (relative imports resolved)."""
    path, found = MODULES[module], set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {imported(name) for name in names if name.split(".")[0] == "verispec"}
    return found - {module}


GRAPH = {module: imports(module) for module in MODULES}


def a_cycle() -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for other in sorted(GRAPH[module]):
            if state.get(other) == 1:
                return path[path.index(other) :] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    return next((cycle for module in sorted(GRAPH) if module not in state and (cycle := visit(module))), None)


def test_the_graph_sees_imports_inside_functions() -> None:
    assert "verispec.serve.app" in GRAPH["verispec.cli.decode"]  # inside serve_command: FastAPI loads on demand
    assert "verispec.models.protocol" in GRAPH["verispec.argument_checks"]


def test_no_import_cycles() -> None:
    cycle = a_cycle()
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def upward(graph: dict[str, set[str]], layer: str) -> set[str]:
    """The imports out of `layer` (a package of verispec) into anything but itself and the modules below it."""
    allowed = tuple(f"verispec.{name}" for name in (layer, *BELOW[layer]))
    inside = lambda module, name: module == name or module.startswith(f"{name}.")
    return {
        f"{module} -> {other}"
        for module in graph
        if inside(module, f"verispec.{layer}")
        for other in graph[module]
        if not any(inside(other, name) for name in allowed)
    }


def test_the_upward_check_sees_any_module_above() -> None:
    """A model that imports sampling (above it, though neither drafters nor the loop) is caught, as is one that
    imports the package itself (whose __init__ loads every layer)."""
    graph = {
        "verispec.models.execution": {"verispec.sampling", "verispec.models.llama", "verispec.kernels.capture"},
        "verispec.models.native": {"verispec", "verispec.errors", "verispec.checkpoints.tokenizer"},
    }
    assert upward(graph, "models") == {
        "verispec.models.execution -> verispec.sampling",
        "verispec.models.native -> verispec",
    }


def test_models_and_kernels_import_nothing_from_the_layers_above() -> None:
    found = upward(GRAPH, "models") | upward(GRAPH, "kernels")
    assert not found, sorted(found)
