"""`pagedserve serve -dp 2`: the default model's greedy text as with one core; on the
simulated runner, an urgent request under a saturating load on both cores, a shared
prefix kept on one core, and a core SIGKILLed mid-load."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.metrics import metric
from tests.support.reliability_helpers import assert_sse_body
from tests.support.waits import wait_idle

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "Water boils at"]
FLAGS = ("--num-kv-blocks", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "256")
STEP_MS = 40


def greedy_texts(server: ServerProcess) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": p, "max_tokens": 16, "temperature": 0}) for p in PROMPTS))
        return [r.json()["choices"][0]["text"] for r in responses]

    return asyncio.run(run())


def test_two_cores_give_the_greedy_text_of_one() -> None:
    _require_default_model()
    one = ServerProcess(*FLAGS)
    try:
        expected = greedy_texts(one)
    finally:
        one.stop()
    two = ServerProcess(*FLAGS, "-dp", "2")
    try:
        assert greedy_texts(two) == expected
        served = [metric(two, "pagedserve_generation_tokens_total", engine=str(i))
                  for i in (0, 1)]
        assert all(served), served  # both cores took requests
    finally:
        two.stop()


@pytest.fixture(scope="module")
def sim_dp() -> ServerProcess:
    _require_default_model()
    server = ServerProcess("-dp", "2", "--simulate-step-ms", str(STEP_MS),
                           "--scheduling-policy", "priority", "--num-kv-blocks", "512",
                           "--max-num-seqs", "16", "--max-num-batched-tokens", "512")
    yield server
    server.stop()


async def ttft(client: httpx.AsyncClient, priority: int, max_tokens: int = 4) -> float:
    start = time.monotonic()
    async with client.stream("POST", "/v1/completions", json={
            "prompt": "hello " * 20, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "priority": priority}) as response:
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - start
        assert response.status_code == 200
    assert first is not None
    return first


# NOTE: a wall-clock bound; without a clock, tests/scheduler proves the urgent admission and
# tests/engine/test_data_parallel.py the balancer's choice
@pytest.mark.timing
def test_an_urgent_request_starts_within_idle_plus_two_steps(sim_dp) -> None:
    async def run() -> tuple[float, list[float]]:
        async with httpx.AsyncClient(base_url=sim_dp.url, timeout=120) as client:
            idle = statistics.median([await ttft(client, -10) for _ in range(3)])
            stop = asyncio.Event()

            async def low() -> None:
                while not stop.is_set():
                    await ttft(client, 10, max_tokens=48)

            load = [asyncio.create_task(low()) for _ in range(48)]  # 3x the seats
            await asyncio.sleep(2.0)
            urgent = [await ttft(client, -10) for _ in range(5)]
            stop.set()
            await asyncio.gather(*load)
            return idle, urgent

    idle, urgent = asyncio.run(run())
    step_s = STEP_MS / 1000
    assert statistics.median(urgent) <= idle + 2 * step_s + 0.05, (idle, urgent)
    wait_idle(sim_dp.url)


def test_a_shared_prefix_lands_on_one_core(sim_dp) -> None:
    prefix = " ".join(f"word{i}" for i in range(250))  # ~500 tokens
    hits_before = [metric(sim_dp, "pagedserve_prefix_cache_hits_total", engine=str(i))
                   for i in (0, 1)]
    for i in range(8):
        response = httpx.post(f"{sim_dp.url}/v1/completions", timeout=60, json={
            "prompt": f"{prefix} question {i}", "max_tokens": 2})
        assert response.status_code == 200
    hits = [metric(sim_dp, "pagedserve_prefix_cache_hits_total", engine=str(i)) - before
            for i, before in zip((0, 1), hits_before, strict=True)]
    assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 7 * 480, hits


def test_a_killed_core_fails_its_requests_and_the_other_finishes() -> None:
    _require_default_model()
    server = ServerProcess("-dp", "2", "--simulate-step-ms", "10", "--num-kv-blocks", "512",
                           "--max-num-seqs", "16")
    try:
        cores = server.child_pids()
        assert len(cores) == 2, cores
        results: list[list[dict]] = []

        def stream() -> None:
            response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "prompt": "hi", "max_tokens": 150, "ignore_eos": True, "stream": True})
            results.append(assert_sse_body(response.text))

        threads = [threading.Thread(target=stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while (metric(server, "pagedserve_num_requests_running") < 8
               and time.monotonic() < deadline):
            time.sleep(0.05)
        on_doomed = int(metric(server, "pagedserve_num_requests_running", engine="1"))
        assert 0 < on_doomed < 8, on_doomed  # both cores took requests (arrivals race the stats)
        os.kill(cores[1], signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        failed = [r for r in results if "error" in r[-1]]
        finished = [r for r in results if r[-1].get("choices", [{}])[0].get("finish_reason")
                    == "length"]
        assert (len(failed), len(finished)) == (on_doomed, 8 - on_doomed), [r[-1] for r in results]
        health = httpx.get(f"{server.url}/health").json()
        assert health["status"] == "degraded" and len(health["dead_engines"]) == 1, health
        response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                              json={"prompt": "after", "max_tokens": 3})
        assert response.status_code == 200
    finally:
        server.stop()
