"""How the project's modules import each other: no import cycle between files, imports between top-level
folders only along the edges of `ALLOWED` (one way: api -> broker -> protocol, engine -> worker -> protocol),
and the torch-free folders (API, broker, coordinator, common, protocol, the launcher) stay torch-free.

The graph is read statically (ast), with every import a file makes counted: top-level, inside functions and
under ``TYPE_CHECKING`` alike, since each is a dependency a reader has to follow."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "broker", "common", "coordinator", "engine", "protocol", "worker", "redserve")
# The top-level folders each folder may import besides itself. common/ and protocol/ are leaves every process may
# use; the API reaches the engines through the broker only; the engine drives its workers, which hold the model,
# its config and the Redis rendezvous of remote pipeline stages (worker/ -> broker/); the coordinator talks to the
# rest through Redis; redserve/ (the CLI, the launcher) sits above them all and nothing imports it.
ALLOWED = {
    "common": set(),
    "protocol": set(),
    "broker": {"protocol", "common"},
    "api": {"broker", "protocol", "common"},
    "coordinator": {"broker", "protocol", "common"},
    "worker": {"broker", "protocol", "common"},
    "engine": {"worker", "broker", "protocol", "common"},
    "redserve": {"api", "broker", "common", "coordinator", "engine", "protocol", "worker"},
}
# What a fresh interpreter that imports every module of a folder must not have loaded. protocol/ is shared by the
# torch side and the Redis side, so it loads neither; msgpack and llguidance (``grammar_spec``) are fine.
BANNED = {
    "api": ("torch", "transformers"),
    "broker": ("torch", "transformers", "flask"),
    "coordinator": ("torch", "transformers", "flask"),
    "common": ("torch", "transformers", "redis", "flask"),
    "protocol": ("torch", "transformers", "redis", "flask"),
    "redserve": ("torch", "transformers"),
}


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


def folder_edges() -> dict[tuple[str, str], list[str]]:
    """Each (importer's folder, imported folder) pair of two different folders: the file-level imports behind it."""
    files = module_files()
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in files.items():
        for target in imports_of(path, set(files)):
            pair = (name.split(".")[0], target.split(".")[0])
            if pair[0] != pair[1]:
                edges.setdefault(pair, []).append(f"{name} -> {target}")
    return edges


def test_the_allowed_folder_edges_run_one_way() -> None:
    assert set(ALLOWED) == set(PACKAGES)
    assert cycles(ALLOWED) == []


def test_folders_import_only_along_the_allowed_edges() -> None:
    illegal = {pair: sorted(found) for pair, found in folder_edges().items() if pair[1] not in ALLOWED[pair[0]]}
    assert illegal == {}


def test_the_folder_graph_is_acyclic() -> None:
    graph = {package: set() for package in PACKAGES}
    for importer, imported in folder_edges():
        graph[importer].add(imported)
    assert cycles(graph) == []


@pytest.mark.parametrize("package", sorted(BANNED))
def test_torch_free_folders_load_none_of_their_banned_modules(package: str) -> None:
    """Every module of the folder, imported in a fresh interpreter: the API, broker client, coordinator and
    launcher processes start fast and fork safely; protocol/ loads neither the model side nor the Redis side."""
    modules = sorted(name for name in module_files() if name.split(".")[0] == package)
    code = ("import importlib, sys\n"
            f"for module in {modules!r}:\n    importlib.import_module(module)\n"
            f"print(sorted(m for m in {BANNED[package]!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_other_installed_distribution_claims_our_top_level_names() -> None:
    """The packages install under their own top-level names (docs/architecture.md, "Install names"): another
    distribution providing one of them (an `api` or `common` from PyPI) would shadow or be shadowed by ours."""
    owners = importlib.metadata.packages_distributions()
    claimed = {name: sorted(set(owners.get(name, [])) - {"redserve"}) for name in PACKAGES}
    assert {name: dists for name, dists in claimed.items() if dists} == {}


# The request path inside api/ (docs/architecture.md, "Request lifecycle"): a handler parses with a protocol module
# (pure: the body and the model's limits in, a typed request out) and runs it with api/serving.py (state, broker,
# answers). Neither of those two reaches the other, or a handler, through any chain of imports.
HANDLERS = {"api.chat", "api.completions", "api.responses"}
PROTOCOL = {"api.protocol", "api.responses_protocol"}
SERVING = {"api.serving"}
REQUEST_PATH_BARS = {"api.serving": PROTOCOL | HANDLERS,
                     "api.protocol": SERVING | HANDLERS, "api.responses_protocol": SERVING | HANDLERS}


def import_chains(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` reaches, with one chain of imports that gets there."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        module = todo.pop()
        for target in sorted(graph.get(module, ())):
            if target not in chains:
                chains[target] = [*chains[module], target]
                todo.append(target)
    return chains


def request_path_violations(graph: dict[str, set[str]]) -> list[str]:
    return [" -> ".join(chain) for module, barred in sorted(REQUEST_PATH_BARS.items())
            for target, chain in sorted(import_chains(graph, module).items()) if target in barred]


def test_the_request_path_runs_one_way() -> None:
    """api/serving.py never calls back into a protocol module (no chat -> protocol -> serving -> protocol), and
    the protocol modules never into serving or a handler."""
    files = module_files()
    assert set(REQUEST_PATH_BARS) | HANDLERS <= set(files)
    graph = {name: imports_of(path, set(files)) - {name} for name, path in files.items()}
    assert request_path_violations(graph) == []


def test_the_request_path_check_sees_an_indirect_hop() -> None:
    graph = {"api.serving": {"api.state"}, "api.state": {"api.protocol"}}
    assert request_path_violations(graph) == ["api.serving -> api.state -> api.protocol"]
