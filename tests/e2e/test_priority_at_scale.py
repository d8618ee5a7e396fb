"""End to end on the default model: an urgent tenant's cached system prompt survives a
low-priority load that cycles the KV pool, and the n choices of a request compute their
prompt once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.metrics import metric

pytestmark = pytest.mark.e2e

# 160 blocks of 16 (2,560 tokens): room for one 1,000-token prompt shared by 8 choices
# (63 + 7 blocks), not for 8 copies of it (504), nor for 3 (189).
NUM_BLOCKS, BLOCK_SIZE = 160, 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    _require_default_model()
    server = ServerProcess(
        "--scheduling-policy", "priority", "--num-kv-blocks", str(NUM_BLOCKS),
        "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512",
    )
    yield server
    server.stop()


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


def test_urgent_system_prompt_survives_a_low_priority_load(server: ServerProcess) -> None:
    system = tokens(0, 200)  # 12 full blocks
    complete(server, system + tokens(50_000, 20), priority=-10)
    # 20 distinct 400-token low-priority prompts, 4 at a time: 500 blocks through the pool
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: complete(server, tokens(1000 + 500 * i, 400), 10), range(20)))
    hits = metric(server, "pagedserve_prefix_cache_hits_total")
    complete(server, system + tokens(60_000, 20), priority=-10)
    assert metric(server, "pagedserve_prefix_cache_hits_total") - hits >= 192


def test_n_choices_compute_the_prompt_once(server: ServerProcess) -> None:
    prompt = tokens(90_000, 1000)
    hits = metric(server, "pagedserve_prefix_cache_hits_total")
    used_blocks = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            response = httpx.get(f"{server.url}/scheduler/state", timeout=60)
            if response.status_code == 503:  # a step outlasted the snapshot timeout (CI load)
                continue
            kv = response.json()["kv_cache"]
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
    assert state["kv_cache"]["num_free_blocks"] == NUM_BLOCKS
