"""`make test`'s scheduling (tests/support/crash_safe_loadscope.py) when a worker dies: the
run ends, the crash reported as one failed test and every other test run, instead of
stalling until CI's timeout as xdist 3.8.0's loadscope does; the test it died on is listed
for make test's one retry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CRASHING_MODULE = """
import os

def test_before(): pass
def test_crash(): os._exit(1)
def test_after(): pass
"""


def run_suite(folder: Path, modules: dict[str, str], *flags: str,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    (folder / "conftest.py").write_text(
        "from tests.support.crash_safe_loadscope import pytest_xdist_make_scheduler  # noqa\n"
    )
    for name, text in modules.items():
        (folder / f"test_{name}.py").write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadscope",
         "--no-loadscope-reorder", "-o", f"cache_dir={folder / '.cache'}", "-o", "timeout=0",
         *flags, str(folder)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
        env={**inherited_env(), **(env or {})},
    )


def inherited_env() -> dict[str, str]:
    """This process's environment without make test's CRASHED_TESTS_FILE: a throwaway suite
    must not list its deliberate crash in the real suite's retry list."""
    return {k: v for k, v in os.environ.items() if k != "CRASHED_TESTS_FILE"}


def test_a_crashed_worker_fails_its_test_and_the_run_still_ends(tmp_path) -> None:
    passing = {f"one_{i}": "def test_only(): pass\n" for i in range(6)}
    done = run_suite(tmp_path, {"a_crash": CRASHING_MODULE, **passing,
                                "z_long": "".join(f"def test_{i}(): pass\n" for i in range(30))})
    assert done.returncode == 1, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    assert "1 failed, 38 passed" in summary, done.stdout
    assert "test_a_crash.py::test_crash" in done.stdout


def test_a_replacement_worker_given_one_test_modules_finishes(tmp_path) -> None:
    # the worker dies on its module's last test; what is left is modules of one test each,
    # the case where a replacement worker used to wait for a second test for ever
    done = run_suite(tmp_path, {"a_crash": "import os\n\ndef test_crash(): os._exit(1)\n",
                                **{f"one_{i}": "def test_only(): pass\n" for i in range(8)}})
    assert "1 failed, 8 passed" in done.stdout.strip().splitlines()[-1], done.stdout


def test_the_test_a_worker_died_on_is_listed_and_passes_when_run_again(tmp_path) -> None:
    # make test's retry: the first run lists the crashed test in CRASHED_TESTS_FILE, the
    # second (--lf) runs only the failed ones; this test dies only on its first run
    crashed = tmp_path / "crashed-tests"
    once = tmp_path / "crashed-once"
    modules = {"a_crash": f"import os, pathlib\n\ndef test_crash():\n"
                          f"    marker = pathlib.Path({str(once)!r})\n"
                          f"    if not marker.exists():\n"
                          f"        marker.touch()\n"
                          f"        os._exit(1)\n",
               **{f"one_{i}": "def test_only(): pass\n" for i in range(3)}}
    first = run_suite(tmp_path, modules, env={"CRASHED_TESTS_FILE": str(crashed)})
    assert "1 failed, 3 passed" in first.stdout.strip().splitlines()[-1], first.stdout
    assert crashed.read_text().strip().endswith("test_a_crash.py::test_crash")
    again = run_suite(tmp_path, {}, "--lf")
    assert again.stdout.strip().splitlines()[-1].startswith("1 passed in"), again.stdout
