"""A real uvicorn server (in a thread) over a scripted engine: client disconnects,
graceful shutdown and the bench client, all without a model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from loadgen.cli import build_bench_config
from loadgen.client import BenchConfig, Result, _send, format_summary, run_bench
from loadgen.workloads import BenchItem
from server.cli import build_parser
from tests.support.engine_helpers import core_of
from tests.support.live_server import LiveServer
from tests.support.reliability_helpers import assert_openai_error
from tests.support.waits import wait_idle


@pytest.fixture
def live(make_fake_engine, live_servers) -> Callable[..., LiveServer]:
    def make(policy: str = "fcfs", step_s: float = 0.0, **config) -> LiveServer:
        engine = make_fake_engine(policy=policy, start=False)
        if step_s:
            core_of(engine).fault_hook = lambda plan: time.sleep(step_s)
        return live_servers(engine, **config)

    return make


def assert_aborted(url: str) -> None:
    """The one request in flight was aborted, well before it could have finished."""
    state = wait_idle(url, timeout_s=2.0)
    assert state["kv_cache"]["usage"] == 0.0
    metrics = httpx.get(f"{url}/metrics").text
    abort = 'pagedserve_request_success_total{finished_reason="abort",model_name="fake-model"}'
    assert f"{abort} 1.0" in metrics


LONG = {"prompt": "hi", "max_tokens": 120, "ignore_eos": True}  # ~1.2 s of steps


def test_streaming_client_disconnect_aborts(live) -> None:
    server = live(step_s=0.01)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    assert_aborted(server.url)


def test_non_streaming_client_disconnect_aborts(live) -> None:
    server = live(step_s=0.01)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=0.3)
    assert_aborted(server.url)


def test_graceful_shutdown_finishes_in_flight_streams(live) -> None:
    server = live(step_s=0.01, shutdown_grace_s=10)
    lines = []
    body = {"prompt": "hi", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line and not lines:
                server.server.should_exit = True  # what SIGTERM does
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2]
    server.thread.join(10)
    assert not server.thread.is_alive()
    assert not server.engine.is_alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


@pytest.mark.parametrize("http_client", ["httpx", "raw"])
def test_bench_client_against_a_live_server(live, http_client) -> None:
    server = live(policy="priority")
    args = build_parser().parse_args([
        "bench", "--url", server.url, "--num-requests", "12", "--concurrency", "4",
        "--input-len", "4:8", "--output-len", "3:6", "--token-id-range", "1:200",
        "--priority-mix", "5:0.5,-5:0.5", "--ignore-eos", "--json",
        "--http-client", http_client,
    ])
    summary = asyncio.run(run_bench(build_bench_config(args)))
    assert summary["num_failed"] == 0, summary["errors"]
    assert summary["model"] == "fake-model"
    assert 12 * 3 <= summary["output_tokens"] <= 12 * 6
    assert set(summary["by_priority"]) == {"5", "-5"}
    assert summary["all"]["ttft_s"]["p50"] is not None
    assert summary["output_token_throughput"] > 0
    table = format_summary(summary)
    assert "12 ok, 0 failed" in table and "TTFT p50/p90/p99" in table and "      -5" in table


def test_the_raw_bench_client_reports_errors(live) -> None:
    server = live()  # fcfs: a priority is a 400
    args = build_parser().parse_args([
        "bench", "--url", server.url, "--num-requests", "2", "--priority-mix", "3",
        "--http-client", "raw",
    ])
    summary = asyncio.run(run_bench(build_bench_config(args)))
    assert summary["num_failed"] == 2
    assert "HTTP 400" in summary["errors"][0] and "priority" in summary["errors"][0]


@pytest.mark.timing
def test_bench_client_asking_logprobs_times_every_token(live) -> None:
    """The fake model's vocabulary is bytes, so some tokens' text is held back (a
    character's first byte); asked for logprobs, each token still comes in a chunk of its
    own and is timed. (timing: a loop that falls a step behind rightly sends two steps'
    tokens in one chunk.)"""
    server = live(step_s=0.01)
    config = BenchConfig(url=server.url, ignore_eos=True, logprobs=0)

    async def send() -> Result:
        async with httpx.AsyncClient(base_url=server.url) as client:
            return await _send(client, config, "fake-model", BenchItem([65, 66, 67], 24))

    result = asyncio.run(send())
    assert result.ok, result.error
    assert result.output_tokens == 24 == result.num_chunks and len(result.itl_s) == 23


def test_bench_client_with_text_prompts_and_request_rate(live) -> None:
    server = live()
    args = build_parser().parse_args([
        "bench", "--url", server.url, "--num-requests", "5", "--request-rate", "50",
        "--input-len", "3", "--output-len", "4", "--no-prompt-token-ids",
    ])
    summary = asyncio.run(run_bench(build_bench_config(args)))
    assert summary["num_failed"] == 0, summary["errors"]
    assert summary["output_tokens"] == 20


def test_hung_step_answers_503_until_it_returns(live) -> None:
    """A step that outlives step_timeout_s: /health and new requests get 503 while it still
    hangs (not queued behind it), and the server serves again once the step returns."""
    server = live()
    release, step_returned = threading.Event(), threading.Event()
    server.engine.step_timeout_s = 0.2

    def hang(plan) -> None:
        release.wait(60)
        step_returned.set()

    core_of(server.engine).fault_hook = hang
    body = {"prompt": "hang", "max_tokens": 2}
    statuses: list[int] = []
    hung = threading.Thread(target=lambda: statuses.append(
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=15).status_code))
    hung.start()
    deadline = time.monotonic() + 10
    while (health := httpx.get(f"{server.url}/health")).status_code == 200:
        assert time.monotonic() < deadline, "a hung step never turned /health to 503"
        time.sleep(0.05)
    assert health.status_code == 503
    assert "step-timeout-s" in health.json()["error"]["message"]
    refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=5)
    assert_openai_error(refused, 503, "step-timeout-s")
    assert not step_returned.is_set()  # refused while the step hangs, not after it
    core_of(server.engine).fault_hook = None
    release.set()
    hung.join(10)
    assert statuses == [200]  # the slow step's request still completes
    wait_idle(server.url)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
