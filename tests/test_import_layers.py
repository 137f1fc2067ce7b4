"""How the project's modules import each other: no import cycle between files, and the torch-free processes
(API, broker client, coordinator, the launcher) stay torch-free.

The graph is read statically (ast), with every import a file makes counted: top-level, inside functions and
under ``TYPE_CHECKING`` alike, since each is a dependency a reader has to follow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "broker", "common", "coordinator", "engine", "protocol", "worker", "redserve")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = path
    return files


def imports_of(path: Path, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_files() -> None:
    files = module_files()
    graph = {name: imports_of(path, set(files)) - {name} for name, path in files.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_ring() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", ["api.app", "broker.client", "coordinator.process", "redserve.cli",
                                    "redserve.stack"])
def test_torch_free_processes_never_load_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_coordinator_reaches_neither_engine_nor_worker() -> None:
    """A process of its own that talks to the rest through Redis: it imports from broker/ (keys, load
    snapshot, control state) and nothing of the model side."""
    files = module_files()
    for name, path in files.items():
        if name.split(".")[0] == "coordinator":
            reached = {m for m in imports_of(path, set(files)) if m.split(".")[0] in ("engine", "worker")}
            assert not reached, f"{name} imports {sorted(reached)}"


def test_protocol_imports_no_tier() -> None:
    """protocol/ is what the tiers share: it imports none of them."""
    files = module_files()
    for name, path in files.items():
        if name.split(".")[0] == "protocol":
            reached = {m for m in imports_of(path, set(files)) if m.split(".")[0] != "protocol"}
            assert not reached, f"{name} imports {sorted(reached)}"


@pytest.mark.parametrize("module", ["protocol", "protocol.grammar_spec", "protocol.output_processor"])
def test_protocol_loads_neither_torch_nor_redis_nor_flask(module: str) -> None:
    code = (f"import sys, {module}; "
            "print(sorted(m for m in ('torch', 'transformers', 'redis', 'flask') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
