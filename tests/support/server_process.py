"""A server in a subprocess on a free loopback port, its output in a temp log file.

Shared by the benchmarks (bench/compare.py, bench/soak.py) and the end-to-end tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def read_rss_kib(pid: int) -> int | None:
    """VmRSS of `pid` in KiB (Linux), None where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pagedserve_command(port: int, flags: Sequence[str]) -> list[str]:
    """`python -m server.cli serve` on 127.0.0.1:port with `flags`."""
    return [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), *flags]


class ServerProcess:
    """Starts `command(port)` (default: pagedserve with `flags`) in `cwd` (default: this
    checkout); `wait_healthy` polls
    GET /health; `terminate` sends SIGTERM and returns the exit status."""

    def __init__(
        self,
        flags: Sequence[str] = (),
        *,
        command: Sequence[str] | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_prefix: str = "pagedserve-",
        cwd: Path = REPO_ROOT,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)
        cmd = list(command) if command is not None else pagedserve_command(self.port, flags)
        # NOTE: the batch store's default directory is one server's: each its own here
        self.data_home = tempfile.mkdtemp(prefix=log_prefix + "data-")
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "XDG_DATA_HOME": self.data_home,
                 **(env or {})},
        )
        self.pid = self.proc.pid

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Until /health answers 200; RuntimeError (with the log's tail) if the process
        exits or the time runs out (then it is killed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.proc.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.log_tail()}")

    def child_pids(self) -> list[int]:
        """The server's child processes (its engine core), not counting multiprocessing's
        resource tracker (Linux /proc)."""
        children = []
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
        return [c for c in children
                if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]

    def log_tail(self, num_chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-num_chars:]

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit status; killed (negative status) after timeout_s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def remove_log(self) -> None:
        """The log and the default data directory."""
        self.log.close()
        os.unlink(self.log.name)
        shutil.rmtree(self.data_home, ignore_errors=True)
