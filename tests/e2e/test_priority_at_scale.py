"""End to end on the default model: an urgent tenant's cached system prompt survives a
low-priority load that cycles the KV pool, and the n choices of a request compute their
prompt once."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model

pytestmark = pytest.mark.e2e

NUM_BLOCKS, BLOCK_SIZE = 96, 16  # a 1,536-token pool


def start_server(num_blocks: int) -> ServerProcess:
    _require_default_model()
    return ServerProcess(
        "--scheduling-policy", "priority", "--num-kv-blocks", str(num_blocks),
        "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512",
    )


@pytest.fixture
def small_pool_server() -> Iterator[ServerProcess]:
    server = start_server(NUM_BLOCKS)
    yield server
    server.stop()


@pytest.fixture
def large_pool_server() -> Iterator[ServerProcess]:
    """Room for 8 unshared copies of a 1,000-token prompt (8 x 63 blocks)."""
    server = start_server(600)
    yield server
    server.stop()


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def complete(server: ServerProcess, prompt: list[int], priority: int, **fields) -> dict:
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
              "priority": priority, **fields},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


def tokens(start: int, n: int) -> list[int]:
    return [1000 + (start + i) % 30000 for i in range(n)]


def test_urgent_system_prompt_survives_a_low_priority_load(
    small_pool_server: ServerProcess,
) -> None:
    server = small_pool_server
    system = tokens(0, 200)  # 12 full blocks
    complete(server, system + tokens(50_000, 20), priority=-10)
    # 24 distinct 200-token low-priority prompts: 300 blocks through a 96-block pool
    for i in range(24):
        complete(server, tokens(1000 + 300 * i, 200), priority=10)
    hits = metric(server, "pagedserve_prefix_cache_hits_total")
    complete(server, system + tokens(60_000, 20), priority=-10)
    assert metric(server, "pagedserve_prefix_cache_hits_total") - hits >= 192


def test_n_choices_compute_the_prompt_once(large_pool_server: ServerProcess) -> None:
    server = large_pool_server
    prompt = tokens(90_000, 1000)
    hits = metric(server, "pagedserve_prefix_cache_hits_total")
    used_blocks = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            kv = httpx.get(f"{server.url}/scheduler/state").json()["kv_cache"]
            used_blocks.append(kv["num_blocks"] - kv["num_free_blocks"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out = complete(server, prompt, priority=0, n=8, max_tokens=24)
    finally:
        done.set()
        watcher.join()
    assert len(out["choices"]) == 8
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    # 7 of the 8 choices find every full block of the prompt (992 of 1,000 tokens) cached
    assert metric(server, "pagedserve_prefix_cache_hits_total") - hits >= 7 * 992
    # one prompt's worth (63 blocks) plus each choice's own tail and outputs (2 blocks),
    # not 8 x 63
    assert used_blocks and max(used_blocks) <= 63 + 8 * 2
    state = httpx.get(f"{server.url}/scheduler/state").json()
    assert state["kv_cache"]["num_free_blocks"] == 600
