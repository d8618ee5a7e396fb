"""End to end on the default model, FCFS server: the official `openai` client, raw HTTP,
every error path (each followed by a working request), disconnects, metrics, SIGTERM."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import ServerProcess
from tests.support.metrics import metric
from tests.support.waits import wait_idle

pytestmark = pytest.mark.e2e

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server(fcfs_server: ServerProcess) -> ServerProcess:
    return fcfs_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def complete(client, model, **kw):
    return client.completions.create(model=model, **{"prompt": PROMPT, "max_tokens": 8, **kw})


def assert_works(client, model) -> None:
    response = complete(client, model, max_tokens=2, temperature=0)
    assert response.choices[0].text and response.usage.completion_tokens == 2


def test_models_and_health(server, client, model) -> None:
    (card,) = client.models.list().data
    assert card.id == model and card.object == "model"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion(client, model) -> None:
    response = complete(client, model, temperature=0)
    assert response.object == "text_completion" and response.model == model
    (choice,) = response.choices
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert choice.model_extra["num_preemptions"] == 0
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == (
        response.usage.prompt_tokens + response.usage.completion_tokens
    )


def test_greedy_is_deterministic_and_streaming_matches(client, model) -> None:
    first = complete(client, model, temperature=0, max_tokens=12).choices[0].text
    second = complete(client, model, temperature=0, max_tokens=12).choices[0].text
    chunks = list(complete(client, model, temperature=0, max_tokens=12, stream=True,
                           stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert first == second == streamed
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    finishing = chunks[-2].choices[0]
    assert finishing.finish_reason == "length" and finishing.model_extra["num_preemptions"] == 0


def test_chat(client, model) -> None:
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=8, temperature=0,
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=8, temperature=0, stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == response.choices[0].message.content


def test_n_and_seed_reproducibility(client, model) -> None:
    kw = {"temperature": 1.0, "seed": 1234, "max_tokens": 10, "n": 2}
    first = complete(client, model, **kw)
    second = complete(client, model, **kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens <= 20


def test_stop_string(client, model) -> None:
    full = complete(client, model, temperature=0, max_tokens=16).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = full[: full.index(stop)]
    response = complete(client, model, temperature=0, max_tokens=16, stop=[stop])
    assert response.choices[0].text == cut
    assert response.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in complete(client, model, temperature=0, max_tokens=16,
                                            stop=stop, stream=True)
    )
    assert streamed == cut


def test_logprobs_and_echo(client, model) -> None:
    response = complete(client, model, temperature=0, max_tokens=4, logprobs=2, echo=True)
    choice = response.choices[0]
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    num_prompt = response.usage.prompt_tokens
    assert len(logprobs.tokens) == num_prompt + 4
    # the echoed prompt is scored: every token but the first (tests/e2e/test_lm_eval.py)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:num_prompt])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:num_prompt])
    assert all(lp <= 0 for lp in logprobs.token_logprobs[num_prompt:])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[num_prompt:])


def test_prompt_logprobs_rank_greedy_tokens_first(client, model, default_tokenizer) -> None:
    """The greedy continuation fed back as the prompt (twice: the second a prefix-cache
    hit, which prompt_logprobs bypasses): each of its tokens is rank 1 at its position."""
    ids = default_tokenizer.encode(PROMPT)
    text = complete(client, model, prompt=ids, temperature=0, max_tokens=6).choices[0].text
    full = ids + default_tokenizer.encode(text)
    body = {"model": model, "prompt": full, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 2}
    choices = [httpx.post(f"{client.base_url}completions", json=body, timeout=60).json()
               ["choices"][0] for _ in range(2)]
    entries = choices[0]["prompt_logprobs"]
    assert choices[1]["prompt_logprobs"] == entries
    assert len(entries) == len(full) and entries[0] is None
    for i in range(len(ids), len(full)):
        token = entries[i][str(full[i])]
        assert token["rank"] == 1 and token["logprob"] <= 0, (i, entries[i])
    for entry, token_id in zip(entries[1:], full[1:], strict=True):
        assert 2 <= len(entry) <= 3 and str(token_id) in entry
        assert {1, 2} <= {e["rank"] for e in entry.values()}
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())


def test_token_id_prompts(client, model, default_tokenizer) -> None:
    ids = default_tokenizer.encode(PROMPT)
    by_ids = complete(client, model, prompt=ids, temperature=0).choices[0].text
    by_text = complete(client, model, temperature=0).choices[0].text
    assert by_ids == by_text
    batch = complete(client, model, prompt=[ids, ids[:3]], temperature=0, max_tokens=3)
    assert [c.index for c in batch.choices] == [0, 1]


def test_priority_under_fcfs_is_400(server, client, model) -> None:
    response = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": PROMPT, "priority": -1, "max_tokens": 2})
    assert response.status_code == 400
    assert "--scheduling-policy priority" in response.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions",
                    json={"prompt": PROMPT, "priority": 0, "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b'{"prompt": "hi", ', 400, "JSON"),
        (b'{"prompt": "hi", "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
        (b'{"prompt": "hi", "model": "no-such-model"}', 404, "no-such-model"),
        (b'{"prompt": "hi", "max_tokens": 5000}', 400, "maximum context length is 2048"),
    ],
)
def test_error_paths_then_success(server, client, model, body, status, needle) -> None:
    response = httpx.post(f"{server.url}/v1/completions", content=body,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert_works(client, model)


def test_openai_client_sees_openai_errors(client, model) -> None:
    with pytest.raises(openai.NotFoundError):
        complete(client, "gpt-unknown")
    with pytest.raises(openai.BadRequestError, match="2048"):
        complete(client, model, prompt=[100] * 2100)
    with pytest.raises(openai.BadRequestError, match=r"2048.*2040 in the prompt, 16"):
        complete(client, model, prompt=[100] * 2040, max_tokens=16)
    assert_works(client, model)


def test_streaming_disconnect_frees_blocks(server, client, model) -> None:
    before = metric(server, "pagedserve_request_success_total", finished_reason="abort")
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    state = wait_idle(server.url)
    assert state["kv_cache"]["num_free_blocks"] == state["kv_cache"]["num_blocks"]
    assert state["kv_cache"]["usage"] == 0
    after = metric(server, "pagedserve_request_success_total", finished_reason="abort")
    assert after == before + 1
    assert_works(client, model)


def test_non_streaming_disconnect_frees_blocks(server, client, model) -> None:
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    state = wait_idle(server.url)
    assert state["kv_cache"]["usage"] == 0
    assert_works(client, model)


def test_metrics_move_by_the_right_amounts(server, client, model) -> None:
    wait_idle(server.url)
    names = {
        "prompt": ("pagedserve_prompt_tokens_total", {}),
        "generation": ("pagedserve_generation_tokens_total", {}),
        "length": ("pagedserve_request_success_total", {"finished_reason": "length"}),
        "ttft": ("pagedserve_time_to_first_token_seconds_count", {"priority": "0"}),
        "queue": ("pagedserve_request_queue_time_seconds_count", {"priority": "0"}),
        "e2e": ("pagedserve_e2e_request_latency_seconds_count", {}),
        "itl": ("pagedserve_inter_token_latency_seconds_count", {}),
        "queries": ("pagedserve_prefix_cache_queries_total", {}),
    }
    before = {k: metric(server, name, **labels) for k, (name, labels) in names.items()}
    prompt = list(range(1000, 1037))  # 37 tokens: never seen before
    response = complete(client, model, prompt=prompt, max_tokens=5, temperature=0,
                        extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 5
    wait_idle(server.url)
    after = {k: metric(server, name, **labels) for k, (name, labels) in names.items()}
    delta = {k: after[k] - before[k] for k in names}
    assert delta["prompt"] == 37 and delta["generation"] == 5 and delta["length"] == 1
    assert delta["ttft"] == delta["queue"] == delta["e2e"] == 1 and delta["itl"] == 4
    assert delta["queries"] >= 37
    assert metric(server, "pagedserve_kv_cache_usage_perc") == 0
    assert metric(server, "pagedserve_num_requests_running") == 0


def test_prefix_cache_hits_on_a_repeated_prompt(server, client, model) -> None:
    prompt = list(range(2000, 2040))  # 40 tokens: two full blocks of 16
    complete(client, model, prompt=prompt, max_tokens=1)
    before = metric(server, "pagedserve_prefix_cache_hits_total")
    complete(client, model, prompt=prompt, max_tokens=1)
    wait_idle(server.url)
    assert metric(server, "pagedserve_prefix_cache_hits_total") - before >= 32


def test_sigterm_finishes_in_flight_work_and_exits_0(server) -> None:
    """Runs last: it stops the module's server."""
    lines: list[str] = []

    def stream() -> None:
        body = {"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=60) as response:
            lines.extend(line for line in response.iter_lines() if line)

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 10
    while not httpx.get(f"{server.url}/scheduler/state").json()["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert server.terminate() == 0
    thread.join(30)
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
