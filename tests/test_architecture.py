"""The import rule of docs/ARCHITECTURE.md, checked on the source: layers point down, and no module cycles.

Every ``import`` and ``from … import`` counts, at any depth (a lazy import inside a function is still a
dependency, and so is one under ``TYPE_CHECKING``). A module may import its own room (package) and rooms
of lower layers; two rooms of one layer never import each other.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import specserve

PACKAGE = Path(specserve.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),  # the base class of user mistakes
    ("config", "request", "logging", "models"),  # settings, sampling, model files
    # the runtimes; the settings' docs and where settings come from
    ("backends", "config_docs", "config_sources"),
    ("verify", "chat", "structured"),  # pure verifiers over arrays; prompts through a chat template; grammars
    ("sequence",),  # one request inside the engine: tokens, KV accounting, grammar state, counters
    ("drafters",),  # ways of guessing tokens
    ("engine",),  # the step, the scheduler, the draft policy, the prefix cache, the builder
    ("server",),  # the OpenAI HTTP API over one engine
    ("rayserve", "tools"),  # many replicas behind one endpoint; benchmarks and rollout checks
    ("cli",),  # the command line
)
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    """``specserve.engine.builder`` → ``engine``; ``specserve.cli`` → ``cli``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> set[str]:
    """Our modules that ``path`` imports (``from package import name``: the submodule ``name`` if there is
    one, else the package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:  # a submodule by name, else a name defined in the module
                submodule = f"{module}.{alias.name}"
                found.add(submodule if _resolves(submodule) else module)
    return {name for name in found if name.startswith("specserve.") and _resolves(name)}


def _resolves(module: str) -> bool:
    relative = Path(*module.split(".")[1:])
    base = PACKAGE / relative
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    return {_module_name(path): _imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_architecture_page_states_this_rule() -> None:
    """docs/ARCHITECTURE.md's table names the same rooms in the same layers as LAYERS."""
    page = (PACKAGE.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    documented: dict[int, set[str]] = {}
    for layer, rooms in re.findall(r"^\| (\d+) \| ((?:`\w+`(?:, )?)+) \|", page, re.M):
        documented.setdefault(int(layer), set()).update(re.findall(r"`(\w+)`", rooms))
    assert documented == {rank: set(rooms) for rank, rooms in enumerate(LAYERS)}


def test_every_room_has_a_layer() -> None:
    rooms = {_room(module) for module in _graph()} - {""}
    assert rooms <= set(RANK), f"rooms without a layer in LAYERS: {sorted(rooms - set(RANK))}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import that does not point to the importer's room or below it."""
    upward = []
    for module, imported in graph.items():
        room = _room(module)
        for target in imported:
            other = _room(target)
            if other not in ("", room) and RANK[other] >= RANK[room]:
                upward.append(f"{module} -> {target} (layer {RANK[room]} -> {RANK[other]})")
    return sorted(upward)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of module imports (inside a room too: two modules that need each other are one)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in (module, "specserve") or target not in graph:
                continue
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module)
    return cycles


def test_imports_point_down() -> None:
    upward = upward_imports(_graph())
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    cycles = import_cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_forbid() -> None:
    """A drafter importing the engine is upward; two engine modules importing each other are a cycle."""
    graph = {
        "specserve.drafters.ngram": {"specserve.engine.engine", "specserve.sequence"},
        "specserve.engine.engine": {"specserve.engine.builder", "specserve.drafters.ngram"},
        "specserve.engine.builder": {"specserve.engine.engine"},
    }
    assert upward_imports(graph) == ["specserve.drafters.ngram -> specserve.engine.engine (layer 5 -> 6)"]
    cycle = {"specserve.engine.builder", "specserve.engine.engine"}
    assert any(set(found) == cycle for found in import_cycles(graph))


def benchmark_imports(source: str, filename: str = "<source>") -> list[str]:
    """The modules of the repository's ``benchmarks`` package (the measurement harnesses outside the wheel)
    that ``source`` imports, at any depth; ``importlib.import_module("benchmarks…")`` counts too."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found += [node.module or ""]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(node.args[0].value)
    return [name for name in found if name == "benchmarks" or name.startswith("benchmarks.")]


def test_the_package_never_imports_benchmarks() -> None:
    """benchmarks/ may import specserve, never the reverse: it is not in the wheel."""
    found = [
        f"{_module_name(path)} -> {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name in benchmark_imports(path.read_text(), str(path))
    ]
    assert not found, "specserve imports the repository's benchmarks/ (not in the wheel):\n" + "\n".join(
        found
    )


def test_the_benchmarks_check_catches_what_it_forbids() -> None:
    source = """
import benchmarks
import benchmarks_extra, os
from benchmarks.exact_cost import main
from . import benchmarks as local_room
def later():
    from benchmarks import harness
    import importlib
    importlib.import_module("benchmarks.gpu_check")
"""
    found = sorted(benchmark_imports(source))
    assert found == ["benchmarks", "benchmarks", "benchmarks.exact_cost", "benchmarks.gpu_check"]


@pytest.mark.parametrize(
    "module",
    ["specserve.cli", "specserve.server.app", "specserve.engine.builder", "specserve.tools.commands"],
)
def test_heavy_dependencies_stay_lazy(module: str) -> None:
    """Importing the CLI, the server or the builder loads no optional or tool-only dependency."""
    heavy = ("torch", "ray", "matplotlib", "scipy", "httpx", "llama_cpp")
    code = f"import sys, {module}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"importing {module} loaded {done.stdout.strip()}"
