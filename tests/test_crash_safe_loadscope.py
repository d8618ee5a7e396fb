"""`make test`'s scheduling (tests/support/crash_safe_loadscope.py) when a worker dies: the
run ends, the crash reported as one failed test and every other test run, instead of
stalling until CI's timeout as xdist 3.8.0's loadscope does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CRASHING_MODULE = """
import os

def test_before(): pass
def test_crash(): os._exit(1)
def test_after(): pass
"""


def run_suite(folder: Path, modules: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (folder / "conftest.py").write_text(
        "from tests.support.crash_safe_loadscope import pytest_xdist_make_scheduler  # noqa\n"
    )
    for name, text in modules.items():
        (folder / f"test_{name}.py").write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadscope",
         "--no-loadscope-reorder", "-p", "no:cacheprovider", "-o", "timeout=0", str(folder)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )


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
