"""What a request costs the API process, and who pays: /tokenize and /detokenize take a
seat of the tenant and count their tokens in its window, a prompt refused after tokenizing
is charged the tokens it cost, tool-call arguments nest within
--max-tool-arguments-depth (a 400 naming it, never a 500), the Responses input is
translated in one pass, and the echo of a prompt that never ran is not scored token by
token. On the scripted engine (a byte tokenizer): no model needed."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from server.completions import Completions
from server.config import ServerConfig
from server.limits import RequestLimits
from server.rendering import Choice
from server.requests import CompletionRequest
from server.responses_request import ResponsesRequest, chat_messages
from server.tenants import TenantRefused, TenantRegistry, TenantSpec
from tests.support.engine_helpers import step_faults
from tests.support.reliability_helpers import assert_openai_error, assert_sse_body

RATE_KEY = "rate-key"
USER = {"role": "user", "content": "hi"}


def rate_registry(tokens_per_minute: int | None = 100, max_in_flight: int | None = None
                  ) -> TenantRegistry:
    spec = TenantSpec(name="t", api_key_env=["T_KEY"], tokens_per_minute=tokens_per_minute,
                      max_in_flight=max_in_flight)
    return TenantRegistry([spec], environ={"T_KEY": RATE_KEY})


def test_spent_tokens_count_past_the_rate_and_expire_with_the_window() -> None:
    tenant = rate_registry(100).identify(RATE_KEY.encode())
    assert tenant is not None
    seat = tenant.admit(1, now=0.0)
    seat.spend(250, now=0.0)  # the work is done: counted whole, nothing refused
    seat.release()
    try:
        tenant.admit(1, now=59.0)
    except TenantRefused as exc:
        assert exc.status_code == 429 and exc.retry_after_s == 1.0
    else:
        raise AssertionError("a window holding 250 of 100 tokens admitted a request")
    tenant.admit(100, now=60.0).release()  # expired with the window


# ------------------------------------------------------------------ seats and charges


UTILITY = [("/tokenize", {"prompt": "x" * 10}), ("/tokenize", {"messages": [USER]}),
           ("/detokenize", {"tokens": [120] * 10})]


@pytest.mark.parametrize(("path", "body"), UTILITY)
def test_tokenize_and_detokenize_wait_for_a_seat_before_any_work(tenant_client, path,
                                                                 body) -> None:
    client, tenant, calls = tenant_client
    seat = tenant.admit(1)  # a request in flight: the tenant's one seat
    error = assert_openai_error(client.post(path, json=body), 429, "1 requests in flight")
    assert error["code"] == "too_many_requests_in_flight"
    assert calls == [] and tenant.in_flight == 1
    seat.release()
    assert client.post(path, json=body).status_code == 200
    assert calls and tenant.in_flight == 0


def test_tokenize_counts_its_tokens_in_the_window(tenant_client) -> None:
    client, tenant, calls = tenant_client
    assert client.post("/tokenize", json={"prompt": "x" * 90}).json()["count"] == 90
    # 90 counted: a request asking for 10 more fits the 100, one asking for 11 does not
    assert_openai_error(client.post("/v1/completions", json={
        "prompt": [120] * 6, "max_tokens": 5}), 429, "100 tokens per minute")
    assert client.post("/v1/completions", json={"prompt": [120] * 5, "max_tokens": 5}
                       ).status_code == 200
    calls.clear()
    assert_openai_error(client.post("/tokenize", json={"prompt": "x"}), 429,
                        "100 tokens per minute")
    assert calls == [] and tenant.in_flight == 0


def test_tokenize_past_the_window_is_served_and_counted_whole(tenant_client) -> None:
    client, _, calls = tenant_client
    assert client.post("/tokenize", json={"prompt": "x" * 120}).json()["count"] == 120
    calls.clear()  # the work was done: served, then the window refuses what follows
    assert_openai_error(client.post("/tokenize", json={"prompt": "x"}), 429,
                        "100 tokens per minute")
    assert calls == []


def test_detokenize_is_charged_its_tokens_before_decoding(tenant_client) -> None:
    client, tenant, calls = tenant_client
    assert_openai_error(client.post("/detokenize", json={"tokens": [120] * 101}), 429,
                        "Request too large", "100 tokens per minute")
    assert calls == []
    assert client.post("/detokenize", json={"tokens": [120] * 100}).json() == {
        "prompt": "x" * 100}
    assert_openai_error(client.post("/detokenize", json={"tokens": [120]}), 429,
                        "100 tokens per minute")
    assert calls == ["decode"] and tenant.in_flight == 0


TOO_LONG = [  # each 90 tokens once tokenized, over the context (128) with max_tokens 50
    ("/v1/completions", {"prompt": "x" * 90, "max_tokens": 50}),
    ("/v1/completions", {"prompt": ["y", "x" * 89], "max_tokens": 50}),  # 1 + 89
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 72}],
                              "max_tokens": 50}),  # "<user>...\n<assistant>": 90
    ("/v1/responses", {"input": "x" * 72, "max_output_tokens": 50}),
]


@pytest.mark.parametrize(("path", "body"), TOO_LONG)
def test_a_prompt_refused_as_too_long_is_charged_the_tokens_it_cost(tenant_client, path,
                                                                    body) -> None:
    client, tenant, calls = tenant_client
    assert_openai_error(client.post(path, json=body), 400, "maximum context length")
    assert tenant.in_flight == 0
    calls.clear()
    # 90 counted: 11 tokens more are refused before any work, 10 fit
    assert_openai_error(client.post("/v1/completions", json={
        "prompt": [120] * 6, "max_tokens": 5}), 429, "100 tokens per minute")
    assert client.post("/v1/completions", json={"prompt": [120] * 5, "max_tokens": 5}
                       ).status_code == 200
    assert calls == []


def test_a_prompt_over_the_whole_rate_once_tokenized_is_charged_too(tenant_client) -> None:
    client, _, _ = tenant_client
    response = client.post("/v1/completions", json={"prompt": "x" * 95, "max_tokens": 10})
    assert_openai_error(response, 429, "Request too large")  # 105 > 100 once tokenized
    assert_openai_error(client.post("/v1/completions", json={
        "prompt": [120], "max_tokens": 5}), 429, "100 tokens per minute")


# ------------------------------------------------------------------ tool-call arguments


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def assistant_call(arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


def chat_body(arguments: Any) -> dict[str, Any]:
    return {"messages": [USER, assistant_call(arguments)], "max_tokens": 2}


def responses_body(arguments: str) -> dict[str, Any]:
    return {"input": [{"role": "user", "content": "hi"}, {
        "type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}],
        "max_output_tokens": 2}


def tokenize_body(arguments: Any) -> dict[str, Any]:
    return {"messages": [USER, assistant_call(arguments)]}


ARGUMENT_ROUTES = [("/v1/chat/completions", chat_body), ("/v1/responses", responses_body),
                   ("/tokenize", tokenize_body)]


@pytest.fixture
def client(make_fake_engine, open_client) -> TestClient:
    return open_client(make_fake_engine(start=False),
                       ServerConfig(limits=RequestLimits(max_tool_arguments_depth=8)))


@pytest.mark.parametrize(("path", "body_of"), ARGUMENT_ROUTES)
def test_tool_call_arguments_nest_within_their_limit(client, path, body_of) -> None:
    assert client.post(path, json=body_of(nested(8))).status_code == 200
    assert client.post(path, json=body_of('{"a": ' * 7 + "1" + "}" * 7)).status_code == 200
    assert client.post(path, json=body_of("not JSON: [[[[[[[[[")).status_code == 200
    for arguments in (nested(9), '{"a": ' * 9 + "1" + "}" * 9, nested(5000)):
        error = assert_openai_error(client.post(path, json=body_of(arguments)), 400,
                                    "'c1'", "nest deeper than 8 levels",
                                    "--max-tool-arguments-depth")
        assert error["param"] == "messages"


def test_tool_call_arguments_given_as_a_json_value_nest_within_it_too(client) -> None:
    assert client.post("/v1/chat/completions",
                       json=chat_body(json.loads(nested(8)))).status_code == 200
    assert_openai_error(client.post("/v1/chat/completions", json=chat_body(
        json.loads(nested(9)))), 400, "--max-tool-arguments-depth")


def test_the_default_nesting_limit_is_64(make_fake_engine, open_client) -> None:
    client = open_client(make_fake_engine(start=False), ServerConfig())
    assert client.post("/v1/chat/completions", json=chat_body(nested(64))).status_code == 200
    assert_openai_error(client.post("/v1/chat/completions", json=chat_body(nested(65))), 400,
                        "the limit is 64 (set by --max-tool-arguments-depth)")


# ------------------------------------------------------------------ Responses input


def test_consecutive_answer_items_are_one_message_joined_once() -> None:
    items: list[dict[str, Any]] = [{"role": "assistant", "content": "ab"}] * 3
    items += [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]}]
    items += [{"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}]
    items += [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
              for i in range(2)]
    items += [{"role": "assistant", "content": "d"}, {"role": "assistant", "content": "e"}]
    body = ResponsesRequest.model_validate({"input": items})
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
             for i in range(2)]
    assert chat_messages(body) == [  # reasoning after text, text after calls: a new answer
        {"role": "assistant", "content": "ababab"},
        {"role": "assistant", "content": "c", "reasoning_content": "r", "tool_calls": calls},
        {"role": "assistant", "content": "de"},
    ]


# NOTE: timing: joined once, 8 MB of answer take ~10 ms; added text by text they took
# 0.7-3 s (each item copied the answer so far)
@pytest.mark.timing
def test_the_responses_input_translates_in_one_pass() -> None:
    body = ResponsesRequest.model_validate(
        {"input": [{"role": "assistant", "content": "a" * 4000}] * 2048})
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        messages = chat_messages(body)
        best = min(best, time.perf_counter() - started)
    assert messages == [{"role": "assistant", "content": "a" * 8_192_000}]
    assert best < 0.25, best


# ------------------------------------------------------------------ echo of a prompt never run


class CountingServing:
    """What `Completions` reads of the serving: token texts, counted."""

    def __init__(self) -> None:
        self.num_token_texts = 0

    def token_text(self, token_id: int) -> str:
        self.num_token_texts += 1
        return chr(token_id)


def test_the_echo_of_a_prompt_that_never_ran_writes_no_entry_per_token() -> None:
    serving = CountingServing()
    route = Completions(serving)  # type: ignore[arg-type]
    body = CompletionRequest.model_validate({"prompt": [[65] * 8000] * 2, "echo": True,
                                             "logprobs": 0, "max_tokens": 1})
    never_ran = Choice(finish_reason="deadline")
    choice = route._choice(0, never_ran, body, [65] * 8000, ["A" * 8000, "A" * 8000])
    assert choice.text == "A" * 8000 and choice.finish_reason == "deadline"
    assert choice.logprobs is not None and choice.logprobs.tokens == []
    assert route._echo_logprobs([65] * 8000, None, 0, None) is None
    assert serving.num_token_texts == 0


# NOTE: timing: a 1 ms deadline and the core held in a step until it has passed; in the
# full suite on two workers it failed twice in a row (the echo's prompt ran: its deadline
# not yet passed when it was scheduled), alone never. Run apart, with a retry, until the
# race is found.
@pytest.mark.timing
def test_a_streamed_echo_whose_deadline_passed_before_its_prompt_ran(make_fake_engine,
                                                                      live_servers) -> None:
    engine = make_fake_engine(start=False)
    server = live_servers(engine)
    held, go_on = threading.Event(), threading.Event()

    def hold(plan: object) -> None:  # the core, stopped in the blocker's first step
        held.set()
        assert go_on.wait(10)

    step_faults(engine).on_launch = hold
    blocker = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",),
                               kwargs={"json": {"prompt": "hi", "max_tokens": 2},
                                       "timeout": 30})
    blocker.start()
    assert held.wait(10)
    step_faults(engine).on_launch = None
    answer: list[httpx.Response] = []
    body = {"prompt": [[65] * 40] * 3, "echo": True, "logprobs": 0, "max_tokens": 1,
            "stream": True, "deadline_ms": 1}
    echo = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{server.url}/v1/completions", json=body, timeout=30)))
    echo.start()
    deadline = time.monotonic() + 10
    while engine.num_waiting == 0:  # submitted: its 1 ms passed before the core is back
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.01)
    go_on.set()
    echo.join(30)
    blocker.join(30)
    events = assert_sse_body(answer[0].text)
    firsts = {}
    for event in events:
        for choice in event["choices"]:
            firsts.setdefault(choice["index"], choice)
    assert sorted(firsts) == [0, 1, 2]
    for choice in firsts.values():
        assert choice["text"] == "A" * 40 and choice["logprobs"] is None
        assert choice["finish_reason"] == "deadline"
