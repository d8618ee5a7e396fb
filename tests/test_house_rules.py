"""The house's size rules and its map (issue 29): no module over 500 lines, no function
over 60 lines in the engine and the scheduler, and every shipped module named in
docs/structure.md with its job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("server", "engine", "scheduler", "kvcache", "model_runner", "structured", "loadgen")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _python_files(*SHIPPED, "bench", "tests"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_500_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


def test_no_function_over_60_lines_in_the_engine_and_the_scheduler() -> None:
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for path in _python_files("engine", "scheduler")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_every_shipped_module_has_its_job_in_the_structure_doc() -> None:
    listed = set(re.findall(r"^\| `([^`]+)` \|", (ROOT / "docs/structure.md").read_text(),
                            re.M))
    modules = {str(p.relative_to(ROOT)) for p in _python_files(*SHIPPED)
               if p.name != "__init__.py"}
    assert not modules - listed, sorted(modules - listed)
    stale = {m for m in listed if m.endswith(".py") and not (ROOT / m).exists()}
    assert not stale, sorted(stale)


def test_the_modules_run_first_exist() -> None:
    """tests/conftest.py's LONGEST_MODULES (started first by `make test`) name real files."""
    from tests.conftest import LONGEST_MODULES

    missing = [m for m in LONGEST_MODULES if not (ROOT / m).is_file()]
    assert not missing, missing
