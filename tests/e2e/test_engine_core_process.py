"""The engine core in its own process, across the boundary: `pagedserve serve
--simulate-step-ms` (no weights; the default model's tokenizer) in a subprocess.

The core SIGKILLed mid-stream, the API process SIGKILLed, SIGTERM draining both, the step
watchdog, and disconnect and preemption storms that leave no KV block held."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.reliability_helpers import (
    assert_openai_error,
    assert_sse_body,
    disconnect_storm,
)
from tests.support.waits import wait_idle

SIM_FLAGS = ("--simulate-step-ms", "20", "--num-kv-blocks", "512", "--max-num-seqs", "16")


def core_pid(server: ServerProcess) -> int:
    children = server.child_pids()
    assert len(children) == 1, children
    return children[0]


def is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, timeout_s: float) -> float:
    start = time.monotonic()
    while not is_gone(pid):
        assert time.monotonic() - start < timeout_s, f"process {pid} still there"
        time.sleep(0.05)
    return time.monotonic() - start


def stream_lines(url: str, body: dict, out: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                out.append(line)
                started.set()


def kill_mid_stream(url: str, pid: int, num_streams: int, start_timeout_s: float,
                    what: str) -> list[list[dict]]:
    """`num_streams` streams far longer than the test (2000 tokens); once each has a token,
    SIGKILL `pid`. Asserts that the server ends every stream (one it left open would end
    by the client's 30 s read timeout instead, with no [DONE]); the SSE events of each."""
    body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
    outputs: list[list[str]] = [[] for _ in range(num_streams)]
    started = [threading.Event() for _ in outputs]
    threads = [threading.Thread(target=stream_lines, args=(url, body, out, ev))
               for out, ev in zip(outputs, started, strict=True)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(start_timeout_s)
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), f"a stream did not end after the {what} died"
    return [assert_sse_body("\n".join(lines)) for lines in outputs]


@pytest.fixture(scope="module")
def sim_server() -> Iterator[ServerProcess]:
    """A simulated server shared by the storms (they leave it idle and whole)."""
    _require_default_model()
    server = ServerProcess("--simulate-step-ms", "2", "--num-kv-blocks", "24",
                           "--block-size", "4", "--max-num-seqs", "8",
                           "--scheduling-policy", "priority")
    yield server
    server.stop()


def test_core_sigkilled_mid_stream_fails_pending_requests_and_health(tmp_path) -> None:
    _require_default_model()
    server = ServerProcess(*SIM_FLAGS)
    try:
        for events in kill_mid_stream(server.url, core_pid(server), 4, 10, "core"):
            assert "killed by SIGKILL" in events[-1]["error"]["message"]
        assert_openai_error(httpx.get(f"{server.url}/health"), 503, "SIGKILL")
        assert httpx.get(f"{server.url}/v1/models").status_code == 200  # the API is up
        late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=5)
        assert_openai_error(late, 503, "engine core died")
        assert_openai_error(httpx.get(f"{server.url}/scheduler/state"), 503)
    finally:
        server.stop()


def test_api_sigkilled_the_core_exits_by_itself() -> None:
    _require_default_model()
    server = ServerProcess(*SIM_FLAGS)
    try:
        pid = core_pid(server)
        server.proc.kill()
        server.proc.wait(10)
        assert wait_gone(pid, 10) < 10
    finally:
        server.remove_log()


def test_sigterm_drains_through_both_processes(tmp_path) -> None:
    _require_default_model()
    server = ServerProcess(*SIM_FLAGS, "--shutdown-grace-s", "10")
    pid = core_pid(server)
    lines: list[str] = []
    started = threading.Event()
    body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True}
    thread = threading.Thread(target=stream_lines, args=(server.url, body, lines, started))
    thread.start()
    assert started.wait(10)
    server.proc.send_signal(signal.SIGTERM)
    thread.join(20)
    events = assert_sse_body("\n".join(lines))
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    server.stop()  # asserts exit status 0
    assert wait_gone(pid, 5) < 5


def test_a_hung_step_turns_health_503_across_the_boundary() -> None:
    _require_default_model()
    server = ServerProcess("--simulate-step-ms", "1000", "--num-kv-blocks", "64",
                           "--step-timeout-s", "0.3")
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        thread = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",),
                                  kwargs={"json": {"prompt": "x", "max_tokens": 1},
                                          "timeout": 30})
        thread.start()
        time.sleep(0.7)
        assert_openai_error(httpx.get(f"{server.url}/health"), 503, "--step-timeout-s")
        thread.join(30)
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()


def test_disconnect_storm_across_the_boundary_frees_every_block(sim_server) -> None:
    rng = random.Random(5)
    bodies = [("/v1/completions", {"prompt": f"storm {i}", "max_tokens": rng.randint(4, 40),
                                   "ignore_eos": True, "priority": rng.choice([0, 3])})
              for i in range(48)]
    result = asyncio.run(disconnect_storm(sim_server.url, bodies, seed=5))
    assert sum(result.outcomes.values()) == 48
    assert result.outcomes.get("vanished", 0) + result.outcomes.get("timeout", 0) > 0
    wait_idle(sim_server.url)


def test_preemption_storm_across_the_boundary_loses_no_token(sim_server) -> None:
    """24 blocks of 4 tokens for 24 requests of up to 48 tokens: preemptions galore; every
    request gets exactly max_tokens tokens (usage and logprob tokens agree)."""
    rng = random.Random(7)
    specs = [(rng.randint(8, 40), rng.choice([-1, 0, 2])) for _ in range(24)]

    async def one(client: httpx.AsyncClient, i: int, max_tokens: int, priority: int) -> dict:
        body = {"prompt": f"p{i}", "max_tokens": max_tokens, "ignore_eos": True,
                "priority": priority, "stream": True, "logprobs": 0,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        events = assert_sse_body("\n".join(lines))
        tokens = [t for e in events for c in e["choices"]
                  for t in (c.get("logprobs") or {}).get("tokens", [])]
        finished = [c for e in events for c in e["choices"] if c.get("finish_reason")]
        return {"tokens": len(tokens), "usage": events[-1]["usage"]["completion_tokens"],
                "finish": finished[-1]["finish_reason"],
                "preemptions": finished[-1]["num_preemptions"]}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=sim_server.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i, *s) for i, s in enumerate(specs)))

    results = asyncio.run(run())
    for (max_tokens, _), result in zip(specs, results, strict=True):
        assert result["finish"] == "length"
        assert result["tokens"] == result["usage"] == max_tokens, result
    assert sum(r["preemptions"] for r in results) > 0
    state = wait_idle(sim_server.url)
    assert state["num_preemptions_total"] > 0
    metrics = httpx.get(f"{sim_server.url}/metrics").text
    assert json.dumps(state)  # JSON all the way through
    assert "pagedserve_num_preemptions_total" in metrics


def test_the_core_process_imports_none_of_the_api(sim_server) -> None:
    """The core is spawned without the API's main module (server.cli, FastAPI, pydantic,
    uvicorn: ~0.7 s of its start and ~25 MB it would keep): pydantic's compiled core is
    mapped in the API process, not in the engine core."""
    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    assert "_pydantic_core" in maps(sim_server.pid)
    assert "_pydantic_core" not in maps(core_pid(sim_server))
