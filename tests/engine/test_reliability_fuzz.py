"""Fuzzing the generation routes with schemathesis, from the server's own OpenAPI schema,
over real HTTP (uvicorn in a thread) on the scripted engine; and hand-made hostile bodies.

Every answer is below 500 and in the schema, every refusal is in OpenAI's error shape,
nothing hangs (each request has a timeout), and afterwards the server is idle, holds no
KV block, passes its integrity check and still serves."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.client import EngineClient, EngineInfo
from kvcache.config import CacheConfig
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from tests.conftest import BYTE_EOS, ByteTokenizer, ScriptedRunner
from tests.support.live_server import LiveServer
from tests.support.reliability_helpers import FUZZED_ROUTES, assert_openai_error, fuzz_operation
from tests.support.waits import wait_idle

POSITIVE_EXAMPLES = 50
NEGATIVE_EXAMPLES = 30


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """One scripted engine under the priority policy (so that `priority` is accepted)."""
    scheduler = Scheduler(
        SchedulerConfig(policy="priority", max_num_seqs=16, max_num_batched_tokens=64,
                        max_model_len=128),
        CacheConfig(num_blocks=64, block_size=4),
    )
    info = EngineInfo("fake-model", scheduler.max_request_len, 257, "priority",
                      ByteTokenizer(), frozenset({BYTE_EOS}))
    live = LiveServer(EngineClient.in_process(scheduler, ScriptedRunner(), info))
    yield live
    live.stop()


def assert_still_serving(url: str) -> None:
    wait_idle(url)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "Hel"


def test_openapi_documents_the_request_and_error_bodies(server) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path, model, chunk in (
        ("/v1/completions", "CompletionRequest", "CompletionStreamResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionChunk"),
    ):
        operation = schema["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "properties" in schema["components"]["schemas"][model]
        responses = operation["responses"]
        assert "422" not in responses
        assert set(responses) == {"200", "400", "401", "403", "404", "408", "413", "429",
                                  "500", "503", "504"}
        for status in ("400", "500", "503"):
            error = responses[status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        assert chunk in str(responses["200"]["content"]["text/event-stream"])
    assert {"ChatMessage", "StreamOptions", "ErrorInfo"} <= set(schema["components"]["schemas"])


@pytest.mark.parametrize("path", FUZZED_ROUTES)
def test_fuzz_valid_requests(server, path) -> None:
    stats = fuzz_operation(server.url, path, max_examples=POSITIVE_EXAMPLES)
    assert stats.statuses.get(200, 0) > 0, stats  # some cases got through to the engine
    assert_still_serving(server.url)


@pytest.mark.parametrize("path", FUZZED_ROUTES)
def test_fuzz_invalid_requests(server, path) -> None:
    stats = fuzz_operation(server.url, path, max_examples=NEGATIVE_EXAMPLES, negative=True)
    assert set(stats.statuses) <= {400, 404}, stats
    assert_still_serving(server.url)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"", "not valid JSON"),
        (b"\xff\xfe{", "not valid JSON"),
        (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "too long"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        (b'{"prompt": "hi \\ud800 there"}', "surrogate"),
        (b'{"prompt": "\\udfff"}', "surrogate"),
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "max_tokens": Infinity}', "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
        (b'{"prompt": "hi", "top_k": 1e20}', "top_k"),
        (b'"just a string"', "JSON object"),
        (b"null", "JSON object"),
        (b'{"prompt": {"nested": ["dict"]}}', "prompt"),
        (b'{"prompt": [1, [2]]}', "prompt"),
        (b'{"prompt": "hi", "n": "many"}', "n"),
        (b'{"prompt": "hi", "stop": [null]}', "stop"),
        # JSON types as the schema names them (lax parsing took these as 1.0, 5 and True)
        (b'{"prompt": "hi", "temperature": true}', "temperature"),
        (b'{"prompt": "hi", "max_tokens": "5"}', "max_tokens"),
        (b'{"prompt": "hi", "stream": 1}', "stream"),
        (b'{"prompt": "hi", "stop_token_ids": [false]}', "stop_token_ids"),
    ],
)
def test_hostile_bodies_are_400(server, body, needle) -> None:
    response = httpx.post(f"{server.url}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=10)
    assert_openai_error(response, 400, needle)


def test_hostile_bodies_then_still_serving(server) -> None:
    # JSON's 7.0 is the integer 7; an int is a number.
    response = httpx.post(f"{server.url}/v1/completions", timeout=10,
                          json={"prompt": "hi", "max_tokens": 3.0, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    # A valid surrogate pair is a character, not an error.
    response = httpx.post(f"{server.url}/v1/completions", timeout=10,
                          content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert response.status_code == 200, response.text
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=10, content=(
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
    ))
    assert_openai_error(response, 400, "surrogate")
    assert_still_serving(server.url)
