"""The HTTP app over an engine with a scripted runner: shapes, streaming and every error."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.config import ServerConfig
from server.limits import RequestLimits
from tests.support.engine_helpers import step_faults
from tests.support.metrics import metric_in
from tests.support.waits import wait_for

SCRIPT = "Hello, wörld! Bye."
SPEC_METRICS = {
    "pagedserve_num_preemptions_total": "counter",
    "pagedserve_prompt_tokens_total": "counter",
    "pagedserve_generation_tokens_total": "counter",
    "pagedserve_request_success_total": "counter",
    "pagedserve_prefix_cache_queries_total": "counter",
    "pagedserve_prefix_cache_hits_total": "counter",
    "pagedserve_num_requests_running": "gauge",
    "pagedserve_num_requests_waiting": "gauge",
    "pagedserve_kv_cache_usage_perc": "gauge",
    "pagedserve_time_to_first_token_seconds": "histogram",
    "pagedserve_inter_token_latency_seconds": "histogram",
    "pagedserve_e2e_request_latency_seconds": "histogram",
    "pagedserve_request_queue_time_seconds": "histogram",
    "pagedserve_num_requests_waiting_by_priority": "gauge",
    "pagedserve_num_requests_running_by_priority": "gauge",
    "pagedserve_num_preemptions_by_priority_total": "counter",
    "pagedserve_request_prefill_time_seconds": "histogram",
    "pagedserve_request_decode_time_seconds": "histogram",
    "pagedserve_iteration_tokens": "histogram",
    "pagedserve_spec_decode_num_drafts_total": "counter",
    "pagedserve_spec_decode_num_draft_tokens_total": "counter",
    "pagedserve_spec_decode_num_accepted_tokens_total": "counter",
    "pagedserve_spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "pagedserve_spec_decode_num_draft_tokens_by_priority_total": "counter",
    "pagedserve_spec_decode_num_accepted_tokens_by_priority_total": "counter",
    "pagedserve_tenant_requests_total": "counter",
    "pagedserve_tenant_prompt_tokens_total": "counter",
    "pagedserve_tenant_generation_tokens_total": "counter",
    "pagedserve_tenant_rejections_total": "counter",
    "pagedserve_tenant_request_queue_time_seconds": "histogram",
    "pagedserve_lora_requests_total": "counter",  # by LoRA adapter (none without)
    "pagedserve_slo_ttft_met_total": "counter",
    "pagedserve_slo_ttft_missed_total": "counter",
    "pagedserve_slo_tpot_met_total": "counter",
    "pagedserve_slo_tpot_missed_total": "counter",
    "pagedserve_slo_refused_total": "counter",
    "pagedserve_slo_goodput_requests_total": "counter",
    "pagedserve_slo_steps_over_tpot_total": "counter",
    "pagedserve_step_cost_seconds": "gauge",
}
# What the Gateway API Inference Extension's endpoint picker reads, by vLLM's names
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
}


@pytest.fixture
def serve(make_fake_engine, open_client) -> Callable[..., tuple[TestClient, Any]]:
    """serve(policy=..., **server_config) -> (TestClient, engine); closed after the test."""

    def make(policy: str = "fcfs", **config):
        engine = make_fake_engine(policy=policy, start=False)
        return open_client(engine, ServerConfig(**config)), engine

    return make


def sse_events(client: TestClient, path: str, body: dict) -> list:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def assert_error(response, status: int, *needles: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"]
    return error


def assert_logged_not_answered(message: str, details: str, log: str) -> None:
    """An internal error's answer names an error id, which the log names beside the
    details; the answer never holds them."""
    assert details not in message
    match = re.search(r"err-[0-9a-f]{32}", message)
    assert match is not None, message
    assert match.group() in log and details in log


def ok(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "Hel"


def test_completion_response_shape(serve) -> None:
    client, _ = serve()
    body = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi"}).json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": SCRIPT.encode()[:16].decode(), "logprobs": None,
                      "finish_reason": "length", "num_preemptions": 0}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_without_content_type_header(serve) -> None:
    client, _ = serve()
    response = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}')
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "He"


def test_completion_prompts_times_n(serve) -> None:
    client, _ = serve()
    body = client.post(
        "/v1/completions", json={"prompt": [[104, 105], [104]], "n": 2, "max_tokens": 2}
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_echo_and_logprobs(serve) -> None:
    client, _ = serve()
    body = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "echo": True, "logprobs": 1}
    ).json()
    (choice,) = body["choices"]
    assert choice["text"] == "hiHel"
    assert "prompt_logprobs" not in choice  # computed for the echo, not asked for
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["h", "i", "H", "e", "l"]
    # the scripted prompt logprobs: token i at -i / 10, behind "~"
    assert logprobs["token_logprobs"] == [None, -0.1, -0.5, -0.5, -0.5]
    assert logprobs["top_logprobs"] == [None, {"~": -0.01, "i": -0.1}, {"H": -0.5},
                                        {"e": -0.5}, {"l": -0.5}]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]


def test_completion_stream(serve) -> None:
    client, _ = serve()
    events = sse_events(client, "/v1/completions", {
        "prompt": "hi", "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True},
    })
    *chunks, usage = events
    assert all(c["object"] == "text_completion" for c in events)
    assert "".join(c["choices"][0]["text"] for c in chunks) == SCRIPT
    assert all("usage" not in c for c in chunks)
    assert all("num_preemptions" not in c["choices"][0] for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["num_preemptions"] == 0
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(SCRIPT.encode()) + 1


def test_completion_stream_with_stop_string_and_echo(serve) -> None:
    client, _ = serve()
    events = sse_events(client, "/v1/completions", {
        "prompt": "hi", "max_tokens": 40, "stream": True, "stop": [", w"], "echo": True,
    })
    assert "".join(e["choices"][0]["text"] for e in events) == "hiHello"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_completion(serve) -> None:
    client, _ = serve()
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True,
    }).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    assert choice["finish_reason"] == "length" and choice["num_preemptions"] == 0
    first = choice["logprobs"]["content"][0]
    assert first == {"token": "H", "logprob": -0.5, "bytes": [72],
                     "top_logprobs": [{"token": "H", "logprob": -0.5, "bytes": [72]}]}
    prompt = "<user>hi\n<assistant>"
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_chat_without_max_tokens_runs_to_eos(serve) -> None:
    client, _ = serve()
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}]}).json()
    assert body["choices"][0]["message"]["content"] == SCRIPT
    assert body["choices"][0]["finish_reason"] == "stop"


def test_chat_stream(serve) -> None:
    client, _ = serve()
    events = sse_events(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
        "max_tokens": 4, "stream_options": {"include_usage": True},
    })
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    role = {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"] for e in events[:2]] == [role, role]
    for index in (0, 1):
        mine = [e["choices"][0] for e in events[2:-1] if e["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == "Hell"
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["num_preemptions"] == 0
    assert events[-1]["usage"]["completion_tokens"] == 8


def test_models_state_and_health(serve) -> None:
    client, _ = serve()
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 128
    assert client.get("/health").status_code == 200
    state = client.get("/scheduler/state").json()
    assert state["policy"] == "fcfs" and state["kv_cache"]["usage"] == 0.0


def test_metrics_expose_exactly_the_spec_names(serve) -> None:
    client, _ = serve()
    ok(client)
    text = client.get("/metrics").text
    types = dict(
        line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE ")
    )
    assert types == SPEC_METRICS | VLLM_METRICS
    ttft = 'pagedserve_time_to_first_token_seconds_count{model_name="fake-model",priority="0"}'
    assert f"{ttft} 1.0" in text
    assert 'pagedserve_generation_tokens_total{model_name="fake-model"} 3.0' in text


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        (b"{not json", ("not valid JSON",)),
        (b"[1, 2]", ("JSON object",)),
        (b"", ("not valid JSON",)),
        (b'{"prompt": "hi", "temperature": 9}', ("temperature",)),
        (b'{"max_tokens": 3}', ("prompt",)),
        (b'{"prompt": "hi", "n": 0}', ("n",)),
        (b'{"prompt": ""}', ("empty",)),
        (b'{"prompt": [300]}', ("300", "257")),
        (b'{"prompt": "hi", "max_tokens": 200}', ("128", "202", "2 in the prompt", "200")),
        (b'{"prompt": "' + b"x" * 130 + b'"}', ("128", "130")),
        (b'{"prompt": "hi", "priority": 1}', ("--scheduling-policy priority",)),
    ],
)
def test_invalid_requests_are_400_then_the_server_still_works(serve, body, needles) -> None:
    client, _ = serve()
    response = client.post("/v1/completions", content=body,
                           headers={"content-type": "application/json"})
    assert_error(response, 400, *needles)
    ok(client)


def test_invalid_chat_is_400(serve) -> None:
    client, _ = serve()
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "x"}]})
    assert_error(response, 400, "messages")
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120})
    assert_error(response, 400, "maximum context length is 128")


def test_unknown_model_is_404(serve) -> None:
    client, _ = serve()
    error = assert_error(client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"}),
                         404, "gpt-9")
    assert error["code"] == "model_not_found" and error["param"] == "model"
    ok(client)


def test_unknown_route_and_method_in_openai_shape(serve) -> None:
    client, _ = serve()
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_priority_under_priority_policy(serve) -> None:
    client, _ = serve(policy="priority")
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                    "priority": -5})
    assert response.status_code == 200


def test_body_too_large_is_413(serve) -> None:
    client, _ = serve(limits=RequestLimits(max_body_bytes=2048))
    assert_error(client.post("/v1/completions", json={"prompt": "x" * 5000}), 413)

    def chunks():
        yield b'{"prompt": "'
        yield b"x" * 5000
        yield b'"}'

    assert_error(client.post("/v1/completions", content=chunks()), 413)
    ok(client)


def test_api_key(serve) -> None:
    client, _ = serve(api_key="s3cret")
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("GET", "/scheduler/state")):
        assert_error(client.request(method, path, json={"prompt": "hi"}), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_error(client.post("/v1/completions", json={"prompt": "hi"}, headers=wrong), 401)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    right = {"Authorization": "Bearer s3cret"}
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           headers=right)
    assert response.status_code == 200


def test_a_metrics_key_closes_metrics_alone(serve) -> None:
    """/metrics takes the metrics key and no other (a scrape-only key for Prometheus); the
    API key and /health are not affected."""
    client, _ = serve(api_key="s3cret", metrics_api_key="scrape")
    assert_error(client.get("/metrics"), 401)
    assert_error(client.get("/metrics", headers={"Authorization": "Bearer s3cret"}), 401)
    scraped = client.get("/metrics", headers={"Authorization": "Bearer scrape"})
    assert scraped.status_code == 200 and "pagedserve_num_requests_running" in scraped.text
    assert client.get("/health").status_code == 200
    assert_error(client.get("/v1/models", headers={"Authorization": "Bearer scrape"}), 401)
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_failed_step_is_500_and_the_next_request_works(serve, caplog) -> None:
    client, engine = serve()
    calls = []

    def fail_first(plan) -> None:
        calls.append(plan)
        if len(calls) == 1:
            raise RuntimeError("injected fault")

    step_faults(engine).on_launch = fail_first
    error = assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 500, "error id")
    assert error["type"] == "server_error"
    assert_logged_not_answered(error["message"], "injected fault", caplog.text)
    ok(client)
    assert client.get("/scheduler/state").json()["kv_cache"]["usage"] == 0.0


def test_failed_step_mid_stream_sends_an_error_event(serve, caplog) -> None:
    client, engine = serve()
    calls = []

    def fail_third(plan) -> None:
        calls.append(plan)
        if len(calls) == 3:
            raise RuntimeError("injected fault")

    step_faults(engine).on_launch = fail_third
    events = sse_events(client, "/v1/completions", {"prompt": "hi", "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "He"
    assert_logged_not_answered(events[-1]["error"]["message"], "injected fault", caplog.text)
    ok(client)


def test_an_unexpected_exception_is_a_500_naming_an_id_the_log_explains(serve, caplog) -> None:
    client, engine = serve()

    async def broken_snapshot(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    engine.snapshot = broken_snapshot
    error = assert_error(client.get("/scheduler/state"), 500, "error id")
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert_logged_not_answered(error["message"], "secret internal detail", caplog.text)
    assert len([r for r in caplog.records if r.exc_info]) == 1  # logged once, not re-raised
    ok(client)


class _Fatal(BaseException):
    pass


def test_dead_engine_answers_503(serve) -> None:
    client, engine = serve()

    def die(plan) -> None:
        raise _Fatal

    step_faults(engine).on_launch = die
    assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 500, "died")
    assert_error(client.get("/health"), 503)
    assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 503)
    assert client.get("/scheduler/state").json()["kv_cache"]["usage"] == 0.0


def test_max_waiting_is_503_with_retry_after(serve) -> None:
    client, engine = serve(max_waiting=1)
    entered, release = threading.Event(), threading.Event()

    def block(plan) -> None:
        entered.set()
        release.wait(10)

    step_faults(engine).on_launch = block
    results = []

    def send() -> None:
        results.append(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))

    threads = [threading.Thread(target=send) for _ in range(2)]
    threads[0].start()
    # NOTE: waits without a tight bound: a third request sent before the second one waits
    # is queued, and every step then blocks for 10 s (minutes on a loaded machine)
    wait_for(entered.is_set, "the first request runs (blocked in its step)", 60)
    threads[1].start()
    wait_for(lambda: engine.num_waiting >= 1, "the second request waits", 60)
    try:
        response = client.post("/v1/completions", json={"prompt": "hi"})
    finally:
        step_faults(engine).on_launch = None
        release.set()
    assert_error(response, 503, "overloaded")
    assert response.headers["retry-after"] == "1"
    for thread in threads:
        thread.join(10)
    assert [r.status_code for r in results] == [200, 200]
    ok(client)


def test_cached_prompt_tokens_reach_usage(serve) -> None:
    client, _ = serve()
    prompt = list(range(40, 60))  # 20 tokens: 4 full blocks of 4 a later request can hit
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    events = sse_events(client, "/v1/completions", {
        "prompt": prompt, "max_tokens": 2, "n": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    # the prompt counts once, with its first choice's cached tokens
    assert events[-1]["usage"]["prompt_tokens"] == 20
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


def test_priority_and_step_metrics(serve) -> None:
    client, engine = serve(policy="priority")
    for priority in (3, -2):
        response = client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 4, "priority": priority})
        assert response.status_code == 200
    text = client.get("/metrics").text
    running = "pagedserve_num_requests_running_by_priority"
    for priority in ("3", "-2"):  # seen running, and none running now
        assert f'{running}{{model_name="fake-model",priority="{priority}"}} 0.0' in text
    assert metric_in(text, "pagedserve_request_prefill_time_seconds_count") == 2
    assert metric_in(text, "pagedserve_request_decode_time_seconds_count") == 2
    # a prefill step and 3 decode steps per request, each of its own
    assert metric_in(text, "pagedserve_iteration_tokens_count") == 8
    assert metric_in(text, "pagedserve_iteration_tokens_sum") == 2 * (2 + 3)
