"""The package's shape, read from its source: no import cycles inside verispec/ (imports inside functions and under
TYPE_CHECKING included), and every module in one of the layers below, importing only from its own layer and the
layers under it, never from one above (docs/architecture.md shows the same table). A module whose package or name is
in no layer fails too, so that a new one is placed on purpose."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "verispec"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
# The layers, lowest first, by the top-level package or module of verispec/ each holds ("": the package's own
# __init__.py, the public API, which loads every layer). Within a layer imports may go sideways (the cycle test still
# holds them); across layers only down.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "openmp", "collector"),  # the exceptions; OpenMP's wait policy; the collector during the import
    ("kernels", "threads"),  # the C++ kernels, their pool and the thread count; nothing of models
    ("checkpoints",),  # HF folders and GGUF files, configs, tokenizers, chat templates, fingerprints
    ("models",),  # the math and its packed fast paths, layouts, how a forward runs, precisions, caches, CausalLM
    ("heads",),  # EAGLE, EAGLE-3 and Medusa networks and their export
    (  # the pure pieces of a step, and the oracle (reference) the tests hold the runtime against
        "argument_checks",
        "proposal",
        "cost_model",
        "sampling",
        "verify",
        "tree",
        "constraint",
        "grammar",
        "vocab_map",
        "retokenize",
        "stats",
        "stops",
        "detokenize",
        "reference",
    ),
    ("drafters",),  # one file per family behind the Drafter protocol; the registry
    ("step", "commit", "generate", "chat", "engine", "spec_bench"),  # the loops, single and batched, and their users
    ("serve", "train"),  # the server; training
    ("bench",),  # measures the methods, servers (serve/) and the training corpus's splits (train/)
    ("cli", ""),  # the command line; the package's API
)
LAYER = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


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


def unit(module: str) -> str:
    """The top-level package or module of verispec/ that holds `module` ("" for the package itself)."""
    return module.split(".")[1] if "." in module else ""


def upward(graph: dict[str, set[str]]) -> set[str]:
    """Every import in `graph` from a module into a layer above its own."""
    return {
        f"{module} -> {other}"
        for module, others in graph.items()
        for other in others
        if LAYER[unit(other)] > LAYER[unit(module)]
    }


def test_every_module_is_in_one_layer() -> None:
    units = {unit(module) for module in MODULES}
    assert not units - set(LAYER), "in no layer"
    assert not set(LAYER) - units, "a layer names what is not there"
    assert len(LAYER) == sum(map(len, LAYERS)), "a unit in two layers"


def test_the_upward_check_sees_any_module_above() -> None:
    """A model that imports sampling (above it, though neither drafters nor the loop) is caught, as is one that
    imports the package itself (whose __init__ loads every layer); a sideways import within a layer is not."""
    graph = {
        "verispec.models.execution": {"verispec.sampling", "verispec.models.llama", "verispec.kernels.capture"},
        "verispec.models.native": {"verispec", "verispec.errors", "verispec.checkpoints.tokenizer"},
        "verispec.sampling": {"verispec.argument_checks"},
    }
    assert upward(graph) == {"verispec.models.execution -> verispec.sampling", "verispec.models.native -> verispec"}


def test_no_module_imports_from_a_layer_above() -> None:
    found = upward(GRAPH)
    assert not found, sorted(found)


def test_the_architecture_doc_shows_these_layers() -> None:
    """docs/architecture.md's table of layers names the same units, row for row, lowest first."""
    section = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    names = lambda cell: {name.removesuffix("/").removesuffix(".py") for name in re.findall(r"`([^`]+)`", cell)}
    shown = [{"" if name == "verispec/__init__" else name for name in names(row)} for row in rows]
    assert shown == [set(units) for units in LAYERS]
