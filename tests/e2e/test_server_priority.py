"""End to end on the default model, priority server with a small KV cache and an API key:
a high-priority request preempts low-priority ones, finishes first, and preemption
changes no one's greedy output."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import PRIORITY_API_KEY, ServerProcess
from tests.support.metrics import metric
from tests.support.waits import wait_idle

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {PRIORITY_API_KEY}"}
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Books "
    "became cheaper, literacy spread across Europe, and ideas travelled faster than ever. "
    "Within fifty years, presses were running in more than two hundred cities, and millions "
    "of volumes had been printed on every subject from theology to astronomy and medicine."
)
LOW_PRIORITY, HIGH_PRIORITY = 10, -10


@pytest.fixture(scope="module")
def server(priority_server: ServerProcess) -> ServerProcess:
    return priority_server


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> dict[str, list[int]]:
    """Two 32-token low-priority prompts and a 56-token high-priority one (blocks of 8)."""
    ids = default_tokenizer.encode(TEXT)
    assert len(ids) >= 64
    return {"low-a": ids[:32], "low-b": ids[32:64], "high": ids[8:64]}


# the lows run 56 tokens (88 of the 128 the cache holds): after the high finishes they outgrow
# the cache and one preempts the other; until then the high has ~50 steps to get in first
MAX_TOKENS = {"low-a": 56, "low-b": 56, "high": 8}
PRIORITIES = {"low-a": LOW_PRIORITY, "low-b": LOW_PRIORITY, "high": HIGH_PRIORITY}


def body(name: str, prompt: list[int], stream: bool = False) -> dict:
    return {
        "prompt": prompt, "max_tokens": MAX_TOKENS[name], "temperature": 0,
        "ignore_eos": True, "priority": PRIORITIES[name], "stream": stream,
    }


def test_api_key_is_required_except_for_health_and_metrics(server) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/scheduler/state")):
        response = httpx.request(method, f"{server.url}{path}", json={"prompt": "hi"})
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    wrong = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"},
                       headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401 and PRIORITY_API_KEY not in wrong.text
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=PRIORITY_API_KEY, max_retries=0)
    response = client.completions.create(
        model=client.models.list().data[0].id, prompt="Hello", max_tokens=2,
        extra_body={"priority": 3},
    )
    assert response.usage.completion_tokens == 2


def test_over_context_on_the_small_cache_is_400(server) -> None:
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH,
                          json={"prompt": [100] * 100, "max_tokens": 40})
    assert response.status_code == 400
    assert "128" in response.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", headers=AUTH,
                    json={"prompt": [100] * 100, "max_tokens": 20, "priority": 1}, timeout=120)
    assert ok.status_code == 200


async def _stream(client: httpx.AsyncClient, name: str, prompt: list[int], progress: dict,
                  finished: list[str]) -> dict:
    text, last = "", None
    async with client.stream("POST", "/v1/completions", json=body(name, prompt, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            choice = chunk["choices"][0]
            text += choice["text"]
            progress[name] = progress.get(name, 0) + 1
            if choice["finish_reason"] is not None:
                last = choice
                finished.append(name)
    assert last is not None
    return {"text": text, "finish_reason": last["finish_reason"],
            "num_preemptions": last["num_preemptions"]}


async def _contend(server: ServerProcess, prompts: dict[str, list[int]]) -> tuple[dict, list]:
    progress: dict[str, int] = {}
    finished: list[str] = []
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
        lows = [asyncio.create_task(_stream(client, n, prompts[n], progress, finished))
                for n in ("low-a", "low-b")]
        deadline = time.monotonic() + 60
        while min(progress.get("low-a", 0), progress.get("low-b", 0)) < 3:
            assert time.monotonic() < deadline, "the low-priority requests did not start"
            await asyncio.sleep(0.01)
        # Both lows hold 5+ of the 16 blocks: the 7 blocks of the high prompt do not fit.
        high = _stream(client, "high", prompts["high"], progress, finished)
        results = await asyncio.gather(high, *lows)
    return dict(zip(("high", "low-a", "low-b"), results, strict=True)), finished


def test_high_priority_preempts_finishes_first_and_outputs_match_solo_runs(
    server, prompts
) -> None:
    solo = {}
    for name, prompt in prompts.items():
        response = httpx.post(f"{server.url}/v1/completions", json=body(name, prompt),
                              headers=AUTH, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["num_preemptions"] == 0
        solo[name] = choice["text"]

    preemptions_before = metric(server, "pagedserve_num_preemptions_total")
    low_preemptions = "pagedserve_num_preemptions_by_priority_total"
    by_priority_before = metric(server, low_preemptions, priority="10")
    results, finished = asyncio.run(_contend(server, prompts))

    assert finished[0] == "high", finished
    assert results["high"]["num_preemptions"] == 0
    assert sum(results[n]["num_preemptions"] for n in ("low-a", "low-b")) >= 1
    new_preemptions = metric(server, "pagedserve_num_preemptions_total") - preemptions_before
    assert new_preemptions > 0
    # every victim was a low-priority request
    assert metric(server, low_preemptions, priority="10") - by_priority_before == new_preemptions
    for name in prompts:
        assert results[name]["finish_reason"] == "length"
        assert results[name]["text"] == solo[name], name

    state = wait_idle(server.url, AUTH)
    assert state["policy"] == "priority"
    assert state["kv_cache"]["usage"] == 0
    assert metric(server, "pagedserve_kv_cache_usage_perc") == 0
    ttft = httpx.get(f"{server.url}/metrics").text
    assert 'priority="-10"' in ttft and 'priority="10"' in ttft
