"""Reliability end to end on the default model: one priority server with a KV cache far too
small (12 blocks of 8 tokens), an API key, debug logging and a short shutdown grace.

A short schemathesis pass against the real model; a preemption storm whose greedy outputs
match solo runs token for token; a storm of clients that vanish; SIGTERM aborting what
outlives the grace period and exiting 0; and the API key never reaching the log."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.reliability_helpers import (
    FUZZED_ROUTES,
    assert_openai_error,
    assert_sse_body,
    disconnect_storm,
    fuzz_operation,
)
from tests.support.waits import wait_idle

pytestmark = pytest.mark.e2e

API_KEY = "sk-reliability-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRACE_S = 0.5
CONTEXT = 96  # 12 blocks of 8 tokens
VOCAB_SIZE = 49152
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Books "
    "became cheaper, literacy spread across Europe, and ideas travelled faster than ever."
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    _require_default_model()
    server = ServerProcess(
        "--scheduling-policy", "priority", "--block-size", "8", "--num-kv-blocks", "12",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--api-key", API_KEY,
        "--shutdown-grace-s", str(GRACE_S), "--log-level", "debug",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer) -> list[int]:
    ids = default_tokenizer.encode(TEXT)
    assert len(ids) >= 40
    return ids


def post(server: ServerProcess, body: dict, timeout: float = 120) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH,
                          timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def test_api_key_is_required_and_compared_whatever_the_case_of_bearer(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}):
        response = httpx.post(f"{server.url}/v1/completions", headers=headers,
                              json={"prompt": "Hi", "max_tokens": 1})
        error = assert_openai_error(response, 401)
        assert error["code"] == "invalid_api_key" and API_KEY not in response.text
    lower = {"Authorization": f"bearer {API_KEY}"}
    response = httpx.post(f"{server.url}/v1/completions", headers=lower,
                          json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert API_KEY not in server.log_tail(10**9)


def _token(t: object) -> object:
    return int(t) % VOCAB_SIZE if isinstance(t, int | float) else t


def _bound(path: str, body: dict) -> None:
    """Keeps a fuzzed valid body cheap on a CPU (few tokens out, few and short prompts) and
    more often accepted (our model, token ids in the vocabulary, consistent fields)."""
    body.pop("model", None)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int | float) and body[key] > 4:
            body[key] = 4
    if path == "/v1/completions" and body.get("max_tokens") is None:
        body["max_tokens"] = 4
    if path == "/v1/chat/completions" and not body.get("max_completion_tokens"):
        body["max_tokens"] = min(body.get("max_tokens") or 4, 4)
    if isinstance(body.get("min_tokens"), int | float):
        body["min_tokens"] = 0
    if isinstance(body.get("n"), int | float) and body["n"] > 2:
        body["n"] = 2
    if not body.get("stream"):
        body.pop("stream_options", None)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], list | str):
            del prompt[2:]
        for i, item in enumerate(prompt):
            prompt[i] = [_token(t) for t in item[:24]] if isinstance(item, list) else _token(item)
        del prompt[CONTEXT // 2:]
    if isinstance(body.get("stop_token_ids"), list):
        body["stop_token_ids"] = [_token(t) for t in body["stop_token_ids"]]


@pytest.mark.parametrize("path", FUZZED_ROUTES)
def test_fuzz_against_the_real_model(server, path) -> None:
    valid = fuzz_operation(server.url, path, max_examples=12, headers=AUTH, adjust_body=_bound,
                           timeout_s=60)
    assert valid.statuses.get(200, 0) > 0, valid
    invalid = fuzz_operation(server.url, path, max_examples=8, negative=True, headers=AUTH)
    assert set(invalid.statuses) <= {400, 404}, invalid
    wait_idle(server.url, AUTH)


async def _run(client: httpx.AsyncClient, spec: dict, results: dict) -> None:
    body = {"prompt": spec["prompt"], "max_tokens": spec["max_tokens"], "temperature": 0,
            "ignore_eos": True, "priority": spec["priority"], "logprobs": 0}
    if not spec["stream"]:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        results[spec["name"]] = (choice["text"], choice["logprobs"]["tokens"],
                                 choice["num_preemptions"], choice["finish_reason"])
        return
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines()]
    events = assert_sse_body("\n".join(lines))
    text = "".join(c["text"] for e in events for c in e["choices"])
    tokens = [t for e in events for c in e["choices"]
              for t in (c["logprobs"] or {}).get("tokens", [])]
    last = events[-1]["choices"][0]
    results[spec["name"]] = (text, tokens, last["num_preemptions"], last["finish_reason"])


def test_preemption_storm_outputs_match_solo_runs(server, prompt_ids) -> None:
    """10 greedy requests of three priorities need ~40 blocks; the pool has 12. Each one
    still returns exactly the tokens it returns alone: none lost, none twice."""
    rng = random.Random(7)
    specs = []
    for i in range(10):
        start, length = rng.randint(0, 16), rng.randint(8, 24)
        specs.append({"name": f"r{i}", "prompt": prompt_ids[start:start + length],
                      "max_tokens": rng.randint(8, 14), "priority": rng.choice([-5, 0, 5]),
                      "stream": i % 2 == 0})
    solo = {}
    for spec in specs:
        body = {"prompt": spec["prompt"], "max_tokens": spec["max_tokens"], "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        choice = post(server, body)["choices"][0]
        solo[spec["name"]] = (choice["text"], choice["logprobs"]["tokens"])
    before = httpx.get(f"{server.url}/scheduler/state", headers=AUTH).json()

    async def storm() -> dict:
        results: dict = {}
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=180) as client:
            await asyncio.gather(*(_run(client, spec, results) for spec in specs))
        return results

    results = asyncio.run(storm())
    for spec in specs:
        text, tokens, _, finish_reason = results[spec["name"]]
        assert finish_reason == "length"
        assert len(tokens) == spec["max_tokens"], spec["name"]
        assert (text, tokens) == solo[spec["name"]], spec["name"]
    state = wait_idle(server.url, AUTH)
    assert state["num_preemptions_total"] > before["num_preemptions_total"]
    assert sum(r[2] for r in results.values()) >= 1


def test_disconnect_storm_frees_every_block(server, prompt_ids) -> None:
    rng = random.Random(8)
    bodies = []
    for i in range(24):
        start = rng.randint(0, 20)
        body = {"max_tokens": rng.randint(6, 30), "ignore_eos": True,
                "priority": rng.choice([-1, 0, 2])}
        if i % 4:
            bodies.append(("/v1/completions",
                           {**body, "prompt": prompt_ids[start:start + rng.randint(4, 20)]}))
        else:
            bodies.append(("/v1/chat/completions",
                           {**body, "messages": [{"role": "user", "content": f"Count to {i}."}]}))
    result = asyncio.run(disconnect_storm(server.url, bodies, seed=9, headers=AUTH,
                                          max_chunks=6, timeout_range_s=(0.1, 1.5)))
    assert sum(result.outcomes.values()) == 24
    assert result.outcomes.get("vanished", 0) + result.outcomes.get("timeout", 0) >= 8, result
    wait_idle(server.url, AUTH, timeout_s=30)
    assert post(server, {"prompt": "Hello", "max_tokens": 2})["usage"]["completion_tokens"] == 2


def test_sigterm_aborts_what_outlives_the_grace_period_and_exits_0(server) -> None:
    """Runs last: it stops the module's server."""
    results: dict[str, object] = {}

    def stream(name: str) -> None:
        body = {"prompt": f"Write a long story about {name}.", "max_tokens": 80,
                "ignore_eos": True, "stream": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH,
                              timeout=60)
        results[name] = assert_sse_body(response.text)

    def plain(name: str) -> None:
        body = {"prompt": f"Write a long story about {name}.", "max_tokens": 80,
                "ignore_eos": True}
        results[name] = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH,
                                   timeout=60)

    threads = [threading.Thread(target=stream, args=("a dragon",)),
               threading.Thread(target=stream, args=("a cat",)),
               threading.Thread(target=plain, args=("a ship",))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(httpx.get(f"{server.url}/scheduler/state", headers=AUTH).json()["running"]) < 2:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)
    log_size = Path(server.log.name).stat().st_size
    assert server.terminate() == 0
    for thread in threads:
        thread.join(10)
    # No timeout of the shutdown ran out: uvicorn cancels what is left after grace + flush,
    # and the API process kills a core that does not exit on Shutdown (it then logs it).
    shutdown_log = Path(server.log.name).read_bytes()[log_size:].decode(errors="replace")
    assert "timeout graceful shutdown exceeded" not in shutdown_log, shutdown_log
    assert "the engine core died" not in shutdown_log, shutdown_log
    for name in ("a dragon", "a cat"):
        events = results[name]
        assert events[-1]["choices"][0]["finish_reason"] == "abort", events[-1]
    response = results["a ship"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "abort"
    log = server.log_tail(10**9)
    assert "stopped by SIGTERM" in log
    assert "starting: ServeConfigs(server=ServerConfig(" in log  # the config is logged...
    assert API_KEY not in log, "the API key reached the log"  # ...without the key
    assert json.dumps(API_KEY)[1:-1] not in log
