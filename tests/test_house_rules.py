"""The house's size rules and its map (issue 29): no module over 500 lines, no function
over 60 lines in the engine, the scheduler and the server (the CLI's flag table
excepted: it is data), and every shipped module named in
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


# The CLI's flag table: one `add_argument` call a flag, data rather than logic.
FLAG_TABLES = {("server/cli.py", "add_serve_arguments")}


def _is_flag_table(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Every statement of the body past its docstring a call of `add_argument`, a group
    made, or a call of another `_add_*_arguments` table: no logic."""
    body = [s for s in node.body
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    calls = [s.value if isinstance(s, ast.Expr | ast.Assign) else None for s in body]
    return all(
        isinstance(c, ast.Call) and (
            isinstance(c.func, ast.Attribute)
            and c.func.attr in ("add_argument", "add_argument_group",
                                "add_mutually_exclusive_group")
            or isinstance(c.func, ast.Name) and re.fullmatch(r"_add_\w+_arguments", c.func.id)
        )
        for c in calls)


def test_no_function_over_60_lines_in_the_engine_the_scheduler_and_the_server() -> None:
    long = []
    for path in _python_files("engine", "scheduler", "server"):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assert node.end_lineno is not None
            num_lines = node.end_lineno - node.lineno + 1
            if num_lines <= MAX_FUNCTION_LINES:
                continue
            if (where, node.name) in FLAG_TABLES and _is_flag_table(node):
                continue
            long.append(f"{where}:{node.lineno} {node.name} ({num_lines} lines)")
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
