"""The package's shape, read from its source: no import cycles inside verispec/ (imports inside functions and under
TYPE_CHECKING included), and models/ imports nothing from the layers above it (DESIGN.md's layers)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "verispec"
# The layers above models/ (DESIGN.md): what a model must never import
ABOVE_MODELS = ("drafters", "step", "commit", "generate", "engine", "serve", "bench", "train", "chat", "cli",
                "cli_parser", "cli_output")


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
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    return next((cycle for module in sorted(GRAPH) if module not in state and (cycle := visit(module))), None)


def test_the_graph_sees_imports_inside_functions() -> None:
    assert "verispec.serve.app" in GRAPH["verispec.cli"]  # imported inside _serve, so FastAPI loads on demand
    assert "verispec.models.protocol" in GRAPH["verispec.arguments"]


def test_no_import_cycles() -> None:
    cycle = a_cycle()
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def test_models_import_nothing_from_the_layers_above() -> None:
    above = tuple(f"verispec.{layer}" for layer in ABOVE_MODELS)
    upward = {f"{module} -> {other}" for module in GRAPH if module.startswith("verispec.models")
              for other in GRAPH[module] if any(other == layer or other.startswith(f"{layer}.") for layer in above)}
    assert not upward, sorted(upward)
