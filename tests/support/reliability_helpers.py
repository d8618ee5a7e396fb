"""Shared by the reliability tests (tests/engine, tests/server and tests/e2e): the OpenAI
error shape, a schemathesis fuzz pass over the server's own OpenAPI schema, and storms of
clients that vanish."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

ERROR_KEYS = {"message", "type", "param", "code"}
FUZZED_ROUTES = ("/v1/completions", "/v1/chat/completions")


def assert_openai_error(response: Any, status: int | None = None, *needles: str) -> dict:
    """`response` (httpx or schemathesis) is an error in OpenAI's shape; returns `error`."""
    if status is not None:
        assert response.status_code == status, response.text
    assert response.status_code >= 400, response.text
    body = json.loads(response.text)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def assert_sse_body(text: str) -> list[dict]:
    """A complete event stream: every event a JSON object (a chunk, or one error in OpenAI's
    shape just before the end), ending with `data: [DONE]`; returns the objects."""
    lines = [line for line in text.splitlines() if line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    events = []
    for line in lines[:-1]:
        assert line.startswith("data: "), line
        events.append(json.loads(line[len("data: "):]))
    for event in events[:-1]:
        assert "error" not in event, event
    if events and "error" in events[-1]:
        assert set(events[-1]["error"]) == ERROR_KEYS, events[-1]
    return events


# ------------------------------------------------------------------ fuzzing


@dataclass
class FuzzStats:
    """What a fuzz pass saw, by status code."""

    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


def fuzz_operation(
    url: str,
    path: str,
    *,
    max_examples: int,
    negative: bool = False,
    headers: dict | None = None,
    timeout_s: float = 30.0,
    adjust_body: Callable[[str, dict], None] | None = None,
    stats: FuzzStats | None = None,
) -> FuzzStats:
    """Schemathesis cases for POST `path` from the server's own /openapi.json, positive
    (valid per the schema) or negative, each sent to `url` with a timeout (a hang fails).

    Every answer must be below 500 (but the 504 of a deadline the body set) and conform to
    the schema (status code, content type, body); every refusal must be in OpenAI's error
    shape; every stream must end with
    `data: [DONE]`. `adjust_body(path, body)` may bound a positive body in place (e.g.
    max_tokens on a slow model)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.config import SchemathesisConfig
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    stats = stats or FuzzStats()
    raw_schema = httpx.get(f"{url}/openapi.json", headers=headers, timeout=10).json()
    # Read whole streams (the default stops after 20 events), and never retry a request.
    config = SchemathesisConfig.from_dict({"max-stream-events": 100_000, "request-retries": 0})
    schema = schemathesis.openapi.from_dict(raw_schema, config=config)
    operation = schema[path]["POST"]
    mode = GenerationMode.NEGATIVE if negative else GenerationMode.POSITIVE
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if adjust_body is not None and isinstance(case.body, dict):
            adjust_body(path, case.body)
        response = case.call(base_url=url, headers=headers, timeout=timeout_s)
        stats.add(response.status_code)
        asked_deadline = isinstance(case.body, dict) and "deadline_ms" in case.body
        deadline_passed = response.status_code == 504 and asked_deadline
        case.validate_response(
            response, headers=headers,
            checks=[c for c in checks if not (deadline_passed and c is not_a_server_error)],
        )
        if response.status_code >= 400:
            assert_openai_error(response)
        elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            assert_sse_body(response.text)

    run()
    return stats


# ------------------------------------------------------------------ storms


@dataclass
class StormResult:
    """Outcomes of a storm, by kind: "done" (ran to its end), "vanished" (the client went
    away on purpose), "timeout" (a non-streaming client gave up on purpose), or an error."""

    outcomes: dict[str, int] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)  # name -> text of "done" ones

    def add(self, kind: str) -> None:
        self.outcomes[kind] = self.outcomes.get(kind, 0) + 1


async def vanishing_stream(
    client: httpx.AsyncClient, path: str, body: dict, num_chunks: int
) -> str:
    """Streams `body`, and goes away after `num_chunks` data lines (or reads to the end
    and returns the text when the stream is shorter)."""
    seen, text = 0, ""
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            seen += 1
            if seen > num_chunks:
                return "vanished"
            if line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                for choice in event["choices"]:
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def disconnect_storm(
    url: str,
    bodies: Iterable[tuple[str, dict]],
    *,
    seed: int = 0,
    headers: dict | None = None,
    max_chunks: int = 8,
    timeout_range_s: tuple[float, float] = (0.05, 0.5),
) -> StormResult:
    """Sends every (path, body) at once. A random half streams and hangs up after a random
    number of chunks (0 included: before the first one); the other half does not stream and
    gives up after a random timeout. Any other failure is raised."""
    rng = random.Random(seed)
    result = StormResult()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient, path: str, body: dict) -> None:
        if rng.random() < 0.5:
            outcome = await vanishing_stream(client, path, body, rng.randint(0, max_chunks))
            result.add("vanished" if outcome == "vanished" else "done")
            return
        try:
            response = await client.post(path, json=body, timeout=rng.uniform(*timeout_range_s))
        except httpx.TimeoutException:
            result.add("timeout")
            return
        assert response.status_code == 200, response.text
        result.add("done")

    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=60) as client:
        await asyncio.gather(*(one(client, path, body) for path, body in bodies))
    return result
