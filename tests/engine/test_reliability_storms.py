"""Storms over real HTTP (uvicorn in a thread) on the real Scheduler with scripted runners:
clients that vanish, a KV cache far too small, failing steps, a dying engine loop, and a
shutdown whose grace period runs out. Afterwards nothing is running or waiting, no KV
block is held and the scheduler's integrity check passes."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from scheduler.output import ModelRunnerOutput, SampleLogprobs, SchedulerOutput
from tests.conftest import SyncRunner
from tests.support.engine_helpers import step_faults
from tests.support.live_server import LiveServer
from tests.support.metrics import metric
from tests.support.reliability_helpers import (
    assert_openai_error,
    assert_sse_body,
    disconnect_storm,
)
from tests.support.waits import wait_idle


def expected_text(prompt: str, num_tokens: int) -> str:
    """What PromptRunner generates for `prompt`: letters that depend on the prompt and on
    the position, so that a token sent twice, lost or reordered shows in the text."""
    seed = sum(prompt.encode())
    return "".join(chr(ord("a") + (seed * 31 + k * 7) % 26) for k in range(num_tokens))


class PromptRunner(SyncRunner):
    """Output token k of a request is letter k of expected_text(its prompt); optionally
    sleeps `step_s` and fails a step with probability `fail_p`."""

    def __init__(self, step_s: float = 0.0, fail_p: float = 0.0, seed: int = 0) -> None:
        self.step_s, self.fail_p = step_s, fail_p
        self.rng = random.Random(seed)
        self.num_steps = self.num_failed = 0

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        if self.step_s:
            time.sleep(self.step_s)
        if self.fail_p and self.rng.random() < self.fail_p:
            self.num_failed += 1
            raise RuntimeError("injected step fault")
        out = ModelRunnerOutput()
        for scheduled in plan.scheduled:
            if scheduled.sample:
                prompt = bytes(t for t in scheduled.prompt_token_ids if t < 256).decode()
                k = len(scheduled.output_token_ids)
                token = ord(expected_text(prompt, k + 1)[k])
                out.sampled_token_ids[scheduled.request_id] = token
                if scheduled.sampling_params.logprobs is not None:
                    out.logprobs[scheduled.request_id] = SampleLogprobs(-0.5, [(token, -0.5)])
        return out


@pytest.fixture
def live(make_fake_engine, live_servers) -> Callable[..., LiveServer]:
    def make(runner, *, policy: str = "priority", num_blocks: int = 64, block_size: int = 4,
             max_num_seqs: int = 16, **config) -> LiveServer:
        engine = make_fake_engine(policy=policy, num_blocks=num_blocks, block_size=block_size,
                                  max_num_seqs=max_num_seqs, runner=runner, start=False)
        return live_servers(engine, **config)

    return make


def stream_text(events: list[dict]) -> str:
    return "".join(
        c.get("text") or (c.get("delta") or {}).get("content") or ""
        for e in events if "choices" in e for c in e["choices"]
    )


def assert_still_serving(url: str) -> None:
    wait_idle(url)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 5})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected_text("ok", 5)


# ------------------------------------------------------------------ disconnects


def test_disconnect_storm_frees_everything(live) -> None:
    server = live(PromptRunner(step_s=0.003), max_num_seqs=8)
    rng = random.Random(1)
    bodies = []
    for i in range(64):
        body = {"max_tokens": rng.randint(5, 60), "ignore_eos": True,
                "priority": rng.choice([-1, 0, 3])}
        if i % 3:
            bodies.append(("/v1/completions", {**body, "prompt": f"p{i}"}))
        else:
            bodies.append(("/v1/chat/completions",
                           {**body, "messages": [{"role": "user", "content": f"c{i}"}]}))
    result = asyncio.run(disconnect_storm(server.url, bodies, seed=2, max_chunks=20,
                                          timeout_range_s=(0.02, 0.4)))
    assert sum(result.outcomes.values()) == 64
    assert result.outcomes.get("vanished", 0) >= 10 and result.outcomes.get("timeout", 0) >= 10
    # every request the server received was accounted for once: finished, or aborted.
    # NOTE: on a busy machine a client with a tiny timeout can give up before its request
    # is even sent, and a handler whose client already left can reach the engine late:
    # so every request that did not time out must be counted, and none twice.
    must_count = 64 - result.outcomes.get("timeout", 0)
    deadline = time.monotonic() + 20
    while metric(server, "pagedserve_request_success_total") < must_count:
        assert time.monotonic() < deadline, "requests were never accounted for"
        time.sleep(0.1)
    wait_idle(server.url)
    assert must_count <= metric(server, "pagedserve_request_success_total") <= 64
    assert metric(server, "pagedserve_request_success_total", finished_reason="abort") >= 10
    assert_still_serving(server.url)


# ------------------------------------------------------------------ preemption


async def _one(client: httpx.AsyncClient, i: int, prompt: str, max_tokens: int, priority: int,
               mode: str, results: dict) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "priority": priority, "logprobs": 0}
    if mode == "plain":
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert response.json()["usage"]["completion_tokens"] == max_tokens
        results[i] = (choice["text"], choice["logprobs"]["tokens"], choice["num_preemptions"])
        return
    tokens: list[str] = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if mode == "vanish" and len(lines) > 6:
                return  # this client goes away mid-stream
    events = assert_sse_body("\n".join(lines))
    for event in events:
        for choice in event["choices"]:
            tokens.extend((choice["logprobs"] or {}).get("tokens", []))
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    results[i] = (stream_text(events), tokens, last["num_preemptions"])


def test_preemption_storm_loses_and_repeats_no_token(live) -> None:
    """12 blocks of 4 tokens for 40 requests of up to 30 tokens, four priorities: every
    request that is not aborted gets exactly its tokens, once each, in order."""
    server = live(PromptRunner(step_s=0.001), num_blocks=12, block_size=4, max_num_seqs=8)
    rng = random.Random(3)
    specs = [(f"req {i}:" + "x" * rng.randint(0, 8), rng.randint(4, 20),
              rng.choice([-2, 0, 1, 5]), rng.choice(["plain", "stream", "stream", "vanish"]))
             for i in range(40)]
    results: dict[int, tuple] = {}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await asyncio.gather(*(_one(client, i, *spec, results) for i, spec in enumerate(specs)))

    asyncio.run(run())
    for i, (prompt, max_tokens, _, mode) in enumerate(specs):
        if mode == "vanish":
            continue
        text, tokens, _ = results[i]
        assert text == expected_text(prompt, max_tokens), (i, mode)
        assert "".join(tokens) == text and len(tokens) == max_tokens, (i, mode)
    state = wait_idle(server.url)
    assert state["num_preemptions_total"] >= 10
    assert sum(r[2] for r in results.values()) >= 5
    assert_still_serving(server.url)


# ------------------------------------------------------------------ engine faults


def test_failing_steps_fail_only_their_requests_with_500s(live) -> None:
    runner = PromptRunner(step_s=0.001, fail_p=0.05, seed=4)
    server = live(runner, max_num_seqs=6)
    rng = random.Random(5)
    outcomes: dict[str, int] = {}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt, max_tokens = f"fault {i}", rng.randint(3, 25)
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        want = expected_text(prompt, max_tokens)
        if i % 2:
            response = await client.post("/v1/completions", json=body)
            if response.status_code == 500:
                error = assert_openai_error(response, 500, "internal error in an engine step")
                assert error["type"] == "server_error"
                outcomes["500"] = outcomes.get("500", 0) + 1
            else:
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == want
                outcomes["ok"] = outcomes.get("ok", 0) + 1
            return
        response = await client.post("/v1/completions", json={**body, "stream": True})
        assert response.status_code == 200
        events = assert_sse_body(response.text)
        text = stream_text(events)
        if "error" in events[-1]:
            assert "internal error in an engine step" in events[-1]["error"]["message"]
            assert want.startswith(text)  # what was sent before the fault was right
            outcomes["stream error"] = outcomes.get("stream error", 0) + 1
        else:
            assert text == want
            outcomes["ok"] = outcomes.get("ok", 0) + 1

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await asyncio.gather(*(one(client, i) for i in range(48)))

    asyncio.run(run())
    assert runner.num_failed >= 2
    assert outcomes.get("500", 0) + outcomes.get("stream error", 0) >= 2, outcomes
    assert outcomes.get("ok", 0) >= 10, outcomes
    runner.fail_p = 0.0
    assert_still_serving(server.url)
    assert httpx.get(f"{server.url}/health").status_code == 200


class _Fatal(BaseException):
    """Not an Exception: the engine loop cannot go on."""


def test_a_dead_engine_loop_fails_everything_at_once_and_answers_503(live) -> None:
    runner = PromptRunner(step_s=0.002)
    server = live(runner, max_num_seqs=4)
    engine = server.engine
    started = threading.Event()
    outcomes: list[str] = []

    def die_later(plan: SchedulerOutput) -> None:
        if runner.num_steps >= 15:
            raise _Fatal("the loop is gone")
        if runner.num_steps >= 5:
            started.set()

    step_faults(engine).on_launch = die_later

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"d{i}", "max_tokens": 60, "ignore_eos": True, "stream": i % 2 == 0}
        response = await client.post("/v1/completions", json=body)
        if body["stream"]:
            assert response.status_code == 200
            events = assert_sse_body(response.text)
            assert "died" in events[-1]["error"]["message"]
            outcomes.append("stream error")
        else:
            assert_openai_error(response, 500, "died")
            outcomes.append("500")

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            await asyncio.gather(*(one(client, i) for i in range(12)))  # 4 run, 8 wait

    asyncio.run(run())
    assert started.is_set() and len(outcomes) == 12
    assert_openai_error(httpx.get(f"{server.url}/health"), 503)
    # refused by admission's check of the engine, before any work reaches it
    for path, body in (("/v1/completions", {"prompt": "late"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        assert_openai_error(httpx.post(f"{server.url}{path}", json=body, timeout=5), 503,
                            "The engine is not serving", "the loop is gone")
    state = httpx.get(f"{server.url}/scheduler/state?check=1").json()
    assert state["kv_cache"]["usage"] == 0 and state["integrity"] == "ok"
    assert not state["running"] and not state["waiting"]


# ------------------------------------------------------------------ shutdown


def test_shutdown_aborts_what_outlives_the_grace_period_cleanly(live) -> None:
    # NOTE: wide margins: CI shares two cores
    server = live(PromptRunner(step_s=0.01), shutdown_grace_s=0.6)
    results: dict[str, object] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        results[name] = assert_sse_body(response.text)

    def plain(name: str, max_tokens: int) -> None:
        body = {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True}
        results[name] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)

    threads = [threading.Thread(target=stream, args=("long stream", 110)),
               threading.Thread(target=plain, args=("long plain", 110)),
               threading.Thread(target=stream, args=("short stream", 10))]
    for thread in threads:
        thread.start()
    # all three started: the short stream may be done before the long ones are admitted
    deadline = time.monotonic() + 30
    while (len(httpx.get(f"{server.url}/scheduler/state").json()["running"])
           + ("short stream" in results)) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.stop()  # what SIGTERM does
    for thread in threads:
        thread.join(5)
    # NOTE: no timeout of the shutdown ran out: uvicorn's (grace + flush) would have cut
    # the bodies below short, and the engine's (its core thread's join) would have left
    # the thread running.
    short = results["short stream"]
    assert stream_text(short) == expected_text("short stream", 10)
    assert short[-1]["choices"][0]["finish_reason"] == "length"
    long = results["long stream"]
    assert long[-1]["choices"][0]["finish_reason"] == "abort"
    assert expected_text("long stream", 110).startswith(stream_text(long))
    response = results["long plain"]
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert expected_text("long plain", 110).startswith(choice["text"])
    assert not server.engine.is_alive
    assert server.engine._client.closed  # the core's thread ended, not left behind
    state = asyncio.run(server.engine.snapshot(check_integrity=True))
    assert json.loads(json.dumps(state))["integrity"] == "ok"
