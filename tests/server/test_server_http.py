"""A real uvicorn server (in a thread) over a scripted engine: client disconnects,
graceful shutdown and a hung step, all without a model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.support.engine_helpers import step_faults
from tests.support.live_server import LiveServer
from tests.support.reliability_helpers import assert_openai_error
from tests.support.waits import wait_idle


@pytest.fixture
def live(make_fake_engine, live_servers) -> Callable[..., LiveServer]:
    def make(policy: str = "fcfs", step_s: float = 0.0, **config) -> LiveServer:
        engine = make_fake_engine(policy=policy, start=False)
        if step_s:
            step_faults(engine).on_launch = lambda plan: time.sleep(step_s)
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


def test_hung_step_answers_503_until_it_returns(live) -> None:
    """A step that outlives step_timeout_s: /health and new requests get 503 while it still
    hangs (not queued behind it), and the server serves again once the step returns."""
    server = live()
    release, step_returned = threading.Event(), threading.Event()
    server.engine.step_timeout_s = 0.2

    def hang(plan) -> None:
        release.wait(60)
        step_returned.set()

    step_faults(server.engine).on_launch = hang
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
    step_faults(server.engine).on_launch = None
    release.set()
    hung.join(10)
    assert statuses == [200]  # the slow step's request still completes
    wait_idle(server.url)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
