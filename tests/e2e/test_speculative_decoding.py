"""Speculative decoding on the default model over HTTP: greedy output identical with and
without it (the request's `num_speculative_tokens: 0` turns it off on the same server),
one at a time, batched under preemption, with prefix hits, n > 1, stop strings, a JSON
schema and logprobs; drafts accepted; the pool whole afterwards.

One server for the module: priority scheduling, n-gram speculation, a KV pool of 16
blocks of 16 that the batch below overflows (so it preempts).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.metrics import metric
from tests.support.waits import wait_idle

SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                      "prompt_lookup_min": 2}
CODE = [
    "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n"
    "        print(i, 'odd')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    _require_default_model()
    server = ServerProcess(
        "--scheduling-policy", "priority", "--num-kv-blocks", "16", "--max-num-seqs", "8",
        "--speculative-config", json.dumps(SPECULATIVE_CONFIG),
    )
    yield server
    server.stop()


def chat(server: ServerProcess, code: str, num_speculative_tokens: int | None = None,
         **fields) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": f"Repeat this code exactly:\n\n{code}"}],
            **fields}
    if num_speculative_tokens is not None:
        body["num_speculative_tokens"] = num_speculative_tokens
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def texts(response: dict) -> list[str]:
    return [choice["message"]["content"] for choice in response["choices"]]


@pytest.fixture(scope="module")
def unspeculated(server: ServerProcess) -> list[str]:
    """Each prompt's greedy text without speculation, one at a time."""
    return [texts(chat(server, code, num_speculative_tokens=0))[0] for code in CODE]


def test_one_at_a_time_drafts_are_accepted_and_the_text_is_the_same(server, unspeculated):
    accepted = metric(server, "pagedserve_spec_decode_num_accepted_tokens_total")
    for code, want in zip(CODE, unspeculated, strict=True):
        response = chat(server, code)
        assert texts(response) == [want]
        assert response["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefix hit
    assert metric(server, "pagedserve_spec_decode_num_accepted_tokens_total") > accepted
    wait_idle(server.url)


def test_batched_under_preemption_and_with_n2_the_text_is_the_same(server, unspeculated):
    preemptions = metric(server, "pagedserve_num_preemptions_total")
    jobs = [(code, {"priority": i % 3}) for i, code in enumerate(CODE)]
    jobs.append((CODE[0], {"n": 2}))
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: texts(chat(server, job[0], **job[1])), jobs))
    assert got == [[want] for want in unspeculated] + [[unspeculated[0]] * 2]
    assert metric(server, "pagedserve_num_preemptions_total") > preemptions
    wait_idle(server.url)


def test_a_stop_string_ends_the_text_where_it_would_without_speculation(server, unspeculated):
    stop = unspeculated[1].split("print")[1][:6]  # inside the copied code
    want = texts(chat(server, CODE[1], num_speculative_tokens=0, stop=[stop]))
    got = chat(server, CODE[1], stop=[stop])
    assert texts(got) == want and stop not in want[0]
    assert got["choices"][0]["finish_reason"] == "stop"


def test_a_json_schema_and_logprobs_give_the_same_output(server):
    schema = {"type": "object", "properties": {"code": {"type": "string"}},
              "required": ["code"]}
    fields = {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "c", "schema": schema}}}
    # NOTE: the schema allows more keys, and the model repeats one (`"output":{...`): drafts
    # that the grammar lets through, from its own output
    json_text = texts(chat(server, CODE[0], num_speculative_tokens=0, **fields))
    accepted = metric(server, "pagedserve_spec_decode_num_accepted_tokens_total")
    assert texts(chat(server, CODE[0], **fields)) == json_text
    assert metric(server, "pagedserve_spec_decode_num_accepted_tokens_total") > accepted
    plain = chat(server, CODE[0], num_speculative_tokens=0, logprobs=True, top_logprobs=1)
    speculated = chat(server, CODE[0], logprobs=True, top_logprobs=1)
    want = plain["choices"][0]["logprobs"]["content"]
    got = speculated["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in got] == [t["token"] for t in want]
    assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want], abs=1e-3)


@pytest.mark.parametrize("value", [-1, "four", 1.5])
def test_a_bad_num_speculative_tokens_is_a_400(server, value):
    response = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": "SmolLM2-135M-Instruct", "prompt": "hi", "num_speculative_tokens": value})
    assert response.status_code == 400
    assert "num_speculative_tokens" in response.json()["error"]["message"]
