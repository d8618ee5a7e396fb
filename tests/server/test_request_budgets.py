"""The request budgets of server/limits.py, over HTTP on the scripted engine: each one at
its limit is served and one past it is a 400 naming the limit and its flag; client
mistakes that were 500s are 400s; a tenant's seat and rate are checked before any
tokenizing or templating, and the seat comes back on every path; a request's own chat
template needs --trust-request-chat-template; a template that runs too long is stopped
by --chat-template-timeout-s and frees the tokenizer thread at once."""

from __future__ import annotations

import gc
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.chat_template import DeadlineExceeded, call_with_deadline
from server.config import ServerConfig
from server.limits import LIMIT_FLAGS, RequestLimits, flag_of
from server.requests import ChatTool
from tests.server.conftest import JinjaTokenizer
from tests.support.reliability_helpers import assert_openai_error

USER = {"role": "user", "content": "hi"}
LIMITS = RequestLimits(max_n=3, max_logprobs=4, max_prompt_logprobs_entries=40,
                       max_stop_strings=2, max_stop_string_chars=5, max_logit_bias=3,
                       max_tools=2, max_tools_bytes=300, max_choices=6)


def tool(description: str = "", name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description}}


def tools_of_bytes(size: int) -> list[dict[str, Any]]:
    """One tool whose JSON, as the server measures it, has `size` bytes."""
    base = len(ChatTool.model_validate(tool()).model_dump_json().encode())
    return [tool("d" * (size - base))]


# (limit field, route, body asking for `amount` of what the limit bounds)
BUDGETS: list[tuple[str, str, Callable[[int], dict[str, Any]]]] = [
    ("max_n", "completions", lambda a: {"prompt": "hi", "n": a}),
    ("max_choices", "completions", lambda a: {"prompt": [[104]] * a}),
    ("max_logprobs", "completions", lambda a: {"prompt": "hi", "logprobs": a}),
    ("max_logprobs", "chat", lambda a: {"messages": [USER], "logprobs": True,
                                        "top_logprobs": a}),
    ("max_logprobs", "completions", lambda a: {"prompt": "hi", "prompt_logprobs": a}),
    ("max_prompt_logprobs_entries", "completions",
     lambda a: {"prompt": [104] * a, "prompt_logprobs": 0}),
    ("max_prompt_logprobs_entries", "chat",  # "<user>\n<assistant>": 18 tokens
     lambda a: {"messages": [{"role": "user", "content": "h" * (a - 18)}],
                "prompt_logprobs": 0}),
    ("max_stop_strings", "completions", lambda a: {"prompt": "hi", "stop": ["s"] * a}),
    ("max_stop_string_chars", "chat", lambda a: {"messages": [USER], "stop": "z" * a}),
    ("max_logit_bias", "completions",
     lambda a: {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(a)}}),
    ("max_tools", "chat", lambda a: {"messages": [USER], "tool_choice": "none",
                                     "tools": [tool(name=f"f{i}") for i in range(a)]}),
    ("max_tools_bytes", "chat", lambda a: {"messages": [USER], "tool_choice": "none",
                                           "tools": tools_of_bytes(a)}),
    ("max_tools", "responses", lambda a: {"input": "hi", "tool_choice": "none",
                                          "tools": flat([tool(name=f"f{i}") for i in range(a)])}),
    ("max_tools_bytes", "responses", lambda a: {"input": "hi", "tool_choice": "none",
                                                "tools": flat(tools_of_bytes(a))}),
]


def flat(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat tools in the Responses API's flat shape."""
    return [{"type": "function", **t["function"]} for t in tools]


def path_of(route: str) -> str:
    return {"completions": "/v1/completions", "chat": "/v1/chat/completions",
            "responses": "/v1/responses"}[route]


@pytest.fixture
def client(make_fake_engine):
    engine = make_fake_engine(start=False)
    with TestClient(build_app(engine, ServerConfig(limits=LIMITS))) as test_client:
        yield test_client


@pytest.mark.parametrize(("field_name", "route", "body"), BUDGETS,
                         ids=[f"{f}-{r}" for f, r, _ in BUDGETS])
def test_each_budget_serves_its_limit_and_refuses_one_past_it(client, field_name, route,
                                                              body) -> None:
    limit = getattr(LIMITS, field_name)
    response = client.post(path_of(route), json={"max_tokens": 2, "max_output_tokens": 2,
                                                  **body(limit)})
    assert response.status_code == 200, response.text
    response = client.post(path_of(route), json={"max_tokens": 2, "max_output_tokens": 2,
                                                  **body(limit + 1)})
    assert_openai_error(response, 400, flag_of(field_name), f"the limit is {limit}")


def test_prompt_logprobs_entries_count_tokens_k_and_choices(make_fake_engine) -> None:
    body = {"prompt": [[104] * 5], "prompt_logprobs": 2, "n": 2, "max_tokens": 1}
    for limit, status in ((30, 200), (29, 400)):  # 5 tokens x (2 + 1) x 2 choices
        limits = RequestLimits(max_prompt_logprobs_entries=limit)
        engine = make_fake_engine(start=False)
        with TestClient(build_app(engine, ServerConfig(limits=limits))) as client:
            response = client.post("/v1/completions", json=body)
        assert response.status_code == status, response.text
    assert_openai_error(response, 400, "5 prompt tokens x (2 + 1) x 2 choices",
                        "--max-prompt-logprobs-entries")


@pytest.mark.parametrize("key", ["²", "١٢", "1" * 5000, "-1", " 1"])
def test_a_logit_bias_key_that_is_no_ascii_token_id_is_a_400(client, key) -> None:
    response = client.post("/v1/completions", json={"prompt": "hi", "logit_bias": {key: 1}})
    assert_openai_error(response, 400, "logit_bias", "ASCII decimal digits")


def test_allowed_token_ids_are_bounded_by_the_vocabulary_not_by_their_duplicates(
        client) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "allowed_token_ids": [72, 101] * 70_000}
    response = client.post("/v1/completions", json=body)  # 140,000 ids, 2 distinct
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "He"


def test_the_schema_states_the_servers_own_limits(client) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    assert completion["properties"]["n"]["maximum"] == LIMITS.max_n
    stop_list = completion["properties"]["stop"]["anyOf"][1]
    assert stop_list["maxItems"] == 2 and stop_list["items"]["maxLength"] == 5
    assert chat["properties"]["tools"]["anyOf"][0]["maxItems"] == 2


# ------------------------------------------------------------------ tenants


HOSTILE = [
    ("completions", {"prompt": "x" * 50, "max_tokens": 1}),
    ("chat", {"messages": [{"role": "user", "content": "x" * 50}], "max_tokens": 1}),
    ("responses", {"input": "x" * 50, "max_output_tokens": 1}),
]


@pytest.mark.parametrize(("route", "body"), HOSTILE)
def test_a_tenant_without_a_seat_is_refused_before_any_tokenizing(tenant_client, route,
                                                                   body) -> None:
    client, tenant, calls = tenant_client
    seat = tenant.admit(1)  # a request in flight: the tenant's one seat
    assert_openai_error(client.post(path_of(route), json=body), 429, "1 requests in flight")
    assert calls == []
    seat.release()
    assert client.post(path_of(route), json=body).status_code == 200
    assert calls and tenant.in_flight == 0


@pytest.mark.parametrize(("route", "body"), HOSTILE)
def test_a_full_token_window_is_refused_before_any_tokenizing(tenant_client, route,
                                                              body) -> None:
    client, tenant, calls = tenant_client
    seat = tenant.admit(1)
    seat.charge(100)  # the tenant's 100 tokens of this minute
    seat.release()
    response = client.post(path_of(route), json=body)
    assert_openai_error(response, 429, "100 tokens per minute")
    assert int(response.headers["Retry-After"]) >= 59
    assert calls == [] and tenant.in_flight == 0


def test_the_seat_comes_back_on_every_failure_after_it_was_taken(tenant_client) -> None:
    client, tenant, calls = tenant_client
    failures = [  # NOTE: each refused after tokenizing is charged its tokens (30, then 60)
        ("completions", {"prompt": "x" * 30, "max_tokens": 100}, 400, "maximum context length"),
        ("chat", {"messages": [USER], "chat_template_kwargs": {"chat_template": "x"}},
         400, "--trust-request-chat-template"),
        ("completions", {"prompt": "x" * 60, "max_tokens": 50}, 429, "100 tokens per minute"),
    ]
    for route, body, status, needle in failures:
        assert_openai_error(client.post(path_of(route), json=body), status, needle)
        assert tenant.in_flight == 0, (route, body)
    assert calls == ["encode", "encode"]  # those two failed once tokenized
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}
                       ).status_code == 200


# ------------------------------------------------------------------ chat templates


def jinja_app(make_fake_engine, **config: Any) -> TestClient:
    engine = make_fake_engine(start=False)
    engine.info.tokenizer = JinjaTokenizer()
    return TestClient(build_app(engine, ServerConfig(**config)))


SHOUT = {"messages": [USER], "chat_template_kwargs": {
    "chat_template": "{{ messages[0].content | upper }}!"}}


def test_a_requests_own_template_is_refused_unless_trusted(make_fake_engine) -> None:
    with jinja_app(make_fake_engine) as client:
        for path in ("/tokenize", "/v1/chat/completions"):
            error = assert_openai_error(client.post(path, json=SHOUT), 400,
                                        "--trust-request-chat-template")
            assert error["param"] == "chat_template_kwargs"
        plain = client.post("/tokenize", json={"messages": [USER]}).json()["tokens"]
        assert bytes(plain) == b"<user>hi\n"
    trusted = RequestLimits(trust_request_chat_template=True)
    with jinja_app(make_fake_engine, limits=trusted) as client:
        assert bytes(client.post("/tokenize", json=SHOUT).json()["tokens"]) == b"HI!"
        assert client.post("/v1/chat/completions", json=SHOUT).status_code == 200


# 10^10 iterations, each writing: hours, were it not stopped.
ENDLESS = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}"
           "{% endfor %}")


@pytest.mark.parametrize("whose", ["the request's", "the server's"])
def test_a_template_past_its_time_is_a_400_and_the_tokenizer_thread_serves_on(
        make_fake_engine, live_servers, whose) -> None:
    engine = make_fake_engine(start=False)
    engine.info.tokenizer = JinjaTokenizer()
    limits = RequestLimits(chat_template_timeout_s=0.001, trust_request_chat_template=True)
    chat: dict[str, Any] = {"messages": [USER], "max_tokens": 2}
    if whose == "the server's":
        server = live_servers(engine, limits=limits, chat_template=ENDLESS)
    else:
        server = live_servers(engine, limits=limits)
        chat["chat_template_kwargs"] = {"chat_template": ENDLESS}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
    assert_openai_error(response, 400, "--chat-template-timeout-s", "the limit is 0.001")
    # The same (one) tokenizer thread tokenizes the next request at once.
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_call_with_deadline_stops_at_the_first_call_past_it() -> None:
    ticks = itertools.count()
    calls = 0

    def clock() -> float:  # one tick per look
        return float(next(ticks))

    def forever() -> None:
        nonlocal calls
        while True:
            calls += 1
            abs(-1)  # a C call: no "call" event
            (lambda: None)()  # a Python call: one event, one tick

    with pytest.raises(DeadlineExceeded):
        call_with_deadline(forever, 100.0, clock)
    assert 99 <= calls <= 101
    assert call_with_deadline(lambda: sum(range(1000)), 100.0, clock) == 499500
    before = sys.gettrace()
    with pytest.raises(DeadlineExceeded):
        call_with_deadline(forever, 0.5, clock)
    assert sys.gettrace() is before  # whatever was tracing this thread traces it again


def test_a_call_past_its_deadline_leaves_finalizers_to_finish() -> None:
    # the collector may finalize any thread's objects inside the call (a server's stream):
    # an exception there would be swallowed with its cleanup half done
    now = [0.0]
    closed: list[str] = []

    class Resource:
        me: object = None

        def __del__(self) -> None:
            closed.append(self.close())

        def close(self) -> str:
            return "closed"

    def work() -> None:
        now[0] = 10.0  # past the deadline from here on
        plain, cyclic = Resource(), Resource()
        cyclic.me = cyclic
        del cyclic
        gc.collect()  # a C call: the cycle's __del__ runs inside the collection
        del plain  # its __del__ runs at once
        (lambda: None)()  # the next call of the work itself is stopped

    def late_callback(phase: str, info: dict[str, Any]) -> None:
        noted.append(phase)  # another gc callback, appended after the server's (hypothesis)

    noted: list[str] = []
    gc.callbacks.append(late_callback)
    try:
        with pytest.raises(DeadlineExceeded):
            call_with_deadline(work, 1.0, lambda: now[0])
    finally:
        gc.callbacks.remove(late_callback)
    assert closed == ["closed", "closed"]
    assert noted == ["start", "stop"]


def test_the_operations_doc_lists_every_limit_with_its_default() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    section = doc.split("## Request limits", 1)[1].split("\n## ", 1)[0]
    defaults = RequestLimits()
    for name in LIMIT_FLAGS:
        default = getattr(defaults, name)
        shown = "off" if default is False else "8MiB" if name == "max_body_bytes" else default
        assert f"| `{flag_of(name)}` | {shown} |" in section, name
