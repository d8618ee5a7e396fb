"""`pagedserve serve -tp 2` on the CPU: the default model (SmolLM2-135M: 9 query heads over
3 KV heads, split 2 and 1) gives the same greedy text as `-tp 1`; a worker SIGKILLed
mid-stream fails the streams and /health within 5 s, and no process outlives the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.e2e.test_engine_core_process import core_pid, is_gone, kill_mid_stream, wait_gone
from tests.support.reliability_helpers import assert_openai_error

pytestmark = pytest.mark.e2e

LONG = " ".join(f"Item {i} is a {'red' if i % 2 else 'blue'} box." for i in range(60))
COMPLETIONS = ["The capital of France is", "def fibonacci(n):", LONG + " The last item is"]
QUESTIONS = ["Write a haiku about the sea.",
             "List three prime numbers and explain why each is prime."]


@pytest.fixture(scope="module")
def tp_server() -> Iterator[ServerProcess]:
    """The flags of conftest's fcfs_server, on two ranks; after it stops, its worker is
    gone too."""
    _require_default_model()
    server = ServerProcess("-tp", "2", "--num-kv-blocks", "128", "--max-num-seqs", "16",
                           "--max-num-batched-tokens", "512", "--shutdown-grace-s", "20")
    worker = worker_pid(server)
    yield server
    server.stop()
    assert wait_gone(worker, 5) < 5


def worker_pid(server: ServerProcess) -> int:
    core = core_pid(server)
    children = [int(c) for task in Path(f"/proc/{core}/task").iterdir()
                for c in (task / "children").read_text().split()]
    workers = [c for c in children if b"worker_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(workers) == 1, workers
    return workers[0]


def greedy_texts(url: str) -> list[str]:
    """Every prompt at once (one batch, the long one chunked), greedy, 16 tokens."""

    async def one(client: httpx.AsyncClient, path: str, body: dict) -> str:
        response = await client.post(path, json={**body, "max_tokens": 16, "temperature": 0})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            calls = [one(client, "/v1/completions", {"prompt": p}) for p in COMPLETIONS]
            calls += [one(client, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": q}]}) for q in QUESTIONS]
            return await asyncio.gather(*calls)

    return asyncio.run(run())


def test_tp2_greedy_text_is_tp1s(tp_server, fcfs_server) -> None:
    texts = greedy_texts(tp_server.url)
    assert texts == greedy_texts(fcfs_server.url)
    assert texts == greedy_texts(tp_server.url)  # again, from the prefix cache
    assert all(texts)


def test_worker_sigkilled_mid_stream_fails_streams_and_health(tp_server) -> None:
    """Last in this module: it ends the server's engine."""
    core, worker = core_pid(tp_server), worker_pid(tp_server)
    for events in kill_mid_stream(tp_server.url, worker, 3, 30, "worker"):
        assert "tensor-parallel worker" in events[-1]["error"]["message"]
    assert_openai_error(httpx.get(f"{tp_server.url}/health"), 503, "tensor-parallel worker")
    assert wait_gone(core, 5) < 5 and is_gone(worker)

