"""Random JSON bodies up to --max-body-bytes through every generation route and /tokenize
on the scripted engine, at the default limits: never a 500, always a bounded message, and no
stall of the server's event loop past 200 ms while they are parsed and answered.

The bodies: a small random object (random values under the route's own field names and
others), into which one large part goes: a list of up to millions of small values (empty
arrays and objects, numbers, strings, literals) or an object of many keys, in every list
field of the route's model, in a nested list (content parts, reasoning summaries), in a
known field that takes any JSON (chat_template_kwargs, a message's extra keys) or in an
unknown field; or nesting up to beyond the parser's depth; or a long string.

The stall is measured by a probe on the server's own loop (a task that sleeps 10 ms and
records by how much it overslept, and how much of that the loop's thread spent on the CPU):
the loop's work must stay within 200 ms (it proves the order of the bound, not a time) and
its oversleep within 1 s (the test client's thread and other processes share the cores).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.config import ServerConfig
from server.limits import RequestLimits
from server.requests import ChatCompletionRequest, CompletionRequest
from server.responses_request import ResponsesRequest
from server.utility_routes import TokenizeRequest

pytestmark = pytest.mark.timing

MAX_BODY_BYTES = RequestLimits().max_body_bytes
MAX_MESSAGE_CHARS = 1024
MAX_LOOP_WORK_S = 0.2
MAX_OVERSLEEP_S = 1.0

# route -> (the model of its body, a body it serves, where the large part goes: "@")
ROUTES: dict[str, tuple[Any, dict[str, Any], tuple[str, ...]]] = {
    "/v1/completions": (CompletionRequest, {"prompt": "hi", "max_tokens": 2}, (
        '"prompt": @', '"prompt": [@]', '"stop": @', '"stop_token_ids": @',
        '"allowed_token_ids": @', '"logit_bias": @', '"structured_outputs": {"choice": @}',
        '"response_format": {"type": "json_schema", "json_schema": {"schema": @}}',
        '"unknown": @',
    )),
    "/v1/chat/completions": (ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, (
        '"messages": @', '"messages": [{"role": "user", "content": @}]',
        '"messages": [{"role": "user", "content": "hi", "tool_calls": @}]', '"tools": @',
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": @}}]',
        '"chat_template_kwargs": {"k": @}', '"stop": @', '"unknown": {"k": @}',
    )),
    "/v1/responses": (ResponsesRequest, {"input": "hi", "max_output_tokens": 2}, (
        '"input": @', '"input": [{"role": "user", "content": @}]',
        '"input": [{"type": "reasoning", "summary": @}]', '"tools": @', '"metadata": @',
        '"reasoning": @', '"text": {"format": {"type": "json_schema", "schema": @}}',
        '"unknown": @',
    )),
    "/tokenize": (TokenizeRequest, {"prompt": "hi"}, (
        '"messages": @', '"messages": [{"role": "user", "content": @}]', '"tools": @',
        '"prompt": @', '"chat_template_kwargs": @', '"unknown": @',
    )),
}
ITEMS = (b"[]", b"{}", b"0", b"7", b"-1.5e3", b'""', b'"ab"', b"null", b"true",
         b'{"type": "text", "text": "h"}', b'{"role": "user", "content": "h"}',
         b'"\\u00e9\\ud83d\\ude00"', b'[1, "x", {}]')


@dataclass
class Probe:
    """The worst oversleep of a 10 ms sleep on the loop, and the most CPU time the loop's
    thread spent in one such sleep, since the last `take`."""

    oversleep_s: float = 0.0
    work_s: float = 0.0
    running: bool = True

    async def run(self) -> None:
        while self.running:
            start, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.01)
            self.oversleep_s = max(self.oversleep_s, time.perf_counter() - start - 0.01)
            self.work_s = max(self.work_s, time.thread_time() - cpu)

    def take(self) -> tuple[float, float]:
        worst = self.oversleep_s, self.work_s
        self.oversleep_s = self.work_s = 0.0
        return worst


def large_part(draw: Any) -> bytes:
    """A value of up to about --max-body-bytes: a list or object of many small values,
    deep nesting or a long string."""
    kind = draw(st.sampled_from(["list", "list", "object", "deep", "string"]))
    size = draw(st.sampled_from([1 << 30, 1 << 30, 1 << 20, 10_000, 100]))  # bytes, capped
    budget = min(size, MAX_BODY_BYTES - 4096)
    if kind == "deep":
        depth = draw(st.sampled_from([1, 50, 500, 2000, 100_000]))
        depth = min(depth, budget // 2) or 1
        return b"[" * depth + b"]" * depth
    if kind == "string":
        return b'"' + b"a," * (budget // 2) + b'"'
    item = draw(st.sampled_from(ITEMS))
    if kind == "object":
        num = min(budget // (len(item) + 12), 200_000)
        return b"{" + b",".join(b'"k%d": %s' % (i, item) for i in range(num)) + b"}"
    num = budget // (len(item) + 1)
    return b"[" + b",".join([item] * num) + b"]"


@st.composite
def bodies(draw: Any, route: str) -> bytes:
    model, served, places = ROUTES[route]
    names = st.sampled_from([*model.model_fields, "extra"])
    small = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
        | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                    inner, max_size=4),
        max_leaves=12)
    fields = draw(st.dictionaries(names, small, max_size=4))
    if draw(st.sampled_from([True, True, False])):
        fields = {**fields, **served}
    place = draw(st.sampled_from(places))
    fields.pop(place.split('"')[1], None)
    text = json.dumps(fields).encode()
    inner = text[1:-1] + b", " if len(fields) else b""
    return b"{" + inner + place.encode().replace(b"@", large_part(draw)) + b"}"


@pytest.fixture
def serve(make_fake_engine, open_client) -> Any:
    client = open_client(make_fake_engine(), ServerConfig())
    probe = Probe()
    client.portal.start_task_soon(probe.run)
    yield client, probe
    probe.running = False


@pytest.mark.parametrize("route", list(ROUTES))
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_any_body_is_answered_within_bounds(serve, route: str, data: Any) -> None:
    client, probe = serve
    body = data.draw(bodies(route))
    assert len(body) <= MAX_BODY_BYTES
    probe.take()
    response = client.post(route, content=body, headers={"content-type": "application/json"})
    client.portal.call(asyncio.sleep, 0.02)  # the probe wakes after the last callback
    oversleep_s, work_s = probe.take()
    shown = body[:200]
    assert response.status_code < 500, (response.text[:500], shown)
    if response.status_code != 200:
        message = response.json()["error"]["message"]
        assert len(message) <= MAX_MESSAGE_CHARS, (len(message), shown)
    assert work_s < MAX_LOOP_WORK_S, (work_s, oversleep_s, len(body), shown)
    assert oversleep_s < MAX_OVERSLEEP_S, (work_s, oversleep_s, len(body), shown)
