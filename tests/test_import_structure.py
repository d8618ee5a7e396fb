"""The house's one-way arrows (docs/structure.md), read from the imports of every shipped
module, module-level and lazy alike:

    server -> engine -> scheduler -> kvcache;  engine -> model_runner;  engine -> structured
    server reads of the layers below only their configs, the scheduler's contract and
    the request record it builds (scheduler/placement.py);
    model_runner reads only the scheduler's contract (scheduler/output.py,
    scheduler/sampling_params.py); scheduler and kvcache import no torch;
    the engine imports nothing of server/ and no HTTP; no import loop among our modules;
    no shipped module imports the workshop (bench/) or the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "scheduler", "kvcache", "model_runner", "loadgen", "structured")
# Which of our packages each package may import (itself always).
ALLOWED = {
    "kvcache": set(),
    "scheduler": {"kvcache"},
    "model_runner": {"scheduler"},
    "loadgen": set(),
    "structured": {"scheduler"},
    "engine": {"scheduler", "kvcache", "model_runner", "structured"},
    "server": {"engine", "scheduler", "kvcache", "model_runner", "loadgen", "structured"},
}
SCHEDULER_CONTRACT = {"scheduler.output", "scheduler.sampling_params"}
# What the API process reads of the layers under the engine: configs, the contract, the
# request record admission builds, and how a child process dies with its parent (the
# template workers, as the engine core).
SERVER_READS_BELOW = SCHEDULER_CONTRACT | {"scheduler.placement", "scheduler.config",
                                           "kvcache.config", "model_runner.config",
                                           "model_runner.process_lifetime"}
HTTP_MODULES = {"fastapi", "starlette", "uvicorn", "httpx"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports, resolved to full dotted names."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = _modules()
IMPORTS = {name: _imports(path, name) for name, path in MODULES.items()}


def _ours(imported: set[str]) -> set[str]:
    return {m for m in imported if m in MODULES}


def test_the_shipped_packages_are_found() -> None:
    assert {"server.app", "scheduler.scheduler", "kvcache.block_pool", "model_runner.runner",
            "loadgen.client"} <= set(MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_one_way(name: str) -> None:
    package = name.split(".")[0]
    allowed = ALLOWED[package] | {package}
    for imported in _ours(IMPORTS[name]):
        target = imported.split(".")[0]
        assert target in allowed, f"{name} imports {imported}: {package} may not import {target}"
        if package == "model_runner" and target == "scheduler":
            assert imported in SCHEDULER_CONTRACT, f"{name} imports {imported}, not the contract"
        if package == "server" and target in ("scheduler", "kvcache", "model_runner"):
            assert imported in SERVER_READS_BELOW, f"{name} reaches past the engine: {imported}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.split(".")[0] in
                                        ("scheduler", "kvcache")))
def test_scheduler_and_kvcache_import_no_torch(name: str) -> None:
    third_party = {m.split(".")[0] for m in IMPORTS[name]}
    assert not third_party & {"torch", "numpy", "transformers"}, name


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("engine.")))
def test_the_engine_knows_no_http(name: str) -> None:
    roots = {m.split(".")[0] for m in IMPORTS[name]}
    assert not roots & HTTP_MODULES, f"{name} imports {roots & HTTP_MODULES}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_product_imports_no_workshop_and_no_tests(name: str) -> None:
    """bench/ and tests/ are not installed: a shipped module that imported them would
    fail outside a checkout."""
    found = {m for m in IMPORTS[name] if m.split(".")[0] in ("bench", "tests")}
    assert not found, f"{name} imports {sorted(found)}"


def test_no_import_loops() -> None:
    graph = {name: _ours(imported) - {name} for name, imported in IMPORTS.items()}
    # A package's __init__ is imported with any of its modules: not an edge back.
    graph = {n: {m for m in targets if not n.startswith(m + ".")} for n, targets in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                loop = stack[stack.index(target):] + [target]
                raise AssertionError("import loop: " + " -> ".join(loop))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _absolute_imports(path: Path) -> list[str]:
    """The modules `path` imports by absolute name (from-imports by their module)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


WORKSHOP_AND_TESTS = {_module_name(p): p for folder in ("bench", "tests")
                      for p in (ROOT / folder).rglob("*.py")}


def test_every_import_of_ours_resolves() -> None:
    """The workshop (bench/) and the tests import only modules of ours that exist (a
    bench left pointing at a moved module fails here, not when someone runs it)."""
    trees = {**MODULES, **WORKSHOP_AND_TESTS}
    ours = (*PACKAGES, "bench", "tests")
    missing = [f"{name} imports {target}" for name, path in trees.items()
               for target in _absolute_imports(path)
               if target.split(".")[0] in ours and target not in trees]
    assert not missing, missing


def test_the_tests_import_no_bench() -> None:
    """The workshop may use the tests' helpers (tests/support), never the other way: a test
    runs without bench/. Only the workshop's own tests (tests/bench/) import it."""
    found = [f"{_module_name(p)} imports {m}" for p in (ROOT / "tests").rglob("*.py")
             if not p.is_relative_to(ROOT / "tests" / "bench")
             for m in _imports(p, _module_name(p)) if m.split(".")[0] == "bench"]
    assert not found, found
