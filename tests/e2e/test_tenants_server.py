"""`pagedserve serve --tenants FILE` on the default model: who may ask for what, a
reload on SIGHUP without dropping a request, and no key in the server's log."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.reliability_helpers import assert_openai_error

KEY_A, KEY_B = "e2e-alpha-key", "e2e-beta-key"


def tenants_yaml(alpha_bound: int) -> str:
    return f"""tenants:
  - name: alpha
    api_key_sha256: "{hashlib.sha256(KEY_A.encode()).hexdigest()}"
    max_priority: {alpha_bound}
    max_in_flight: 4
    weight: 2
  - name: beta
    api_key_env: E2E_BETA_KEY
    default_priority: 5
    max_priority: 0
"""


@pytest.fixture(scope="module")
def tenants_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(tenants_yaml(-5))
    return path


@pytest.fixture(scope="module")
def server(tenants_path) -> ServerProcess:
    _require_default_model()
    # one sequence at a time: a request behind another waits, deterministically
    server = ServerProcess("--scheduling-policy", "priority", "--num-kv-blocks", "64",
                           "--max-num-seqs", "1",
                           "--tenants", str(tenants_path), env={"E2E_BETA_KEY": KEY_B})
    yield server
    server.stop()


def post(server: ServerProcess, key: str | None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=120,
                      json={"prompt": "The capital of France is", "max_tokens": 4, **body})


def test_tenants_bound_priorities_and_keys(server) -> None:
    assert_openai_error(post(server, None), 401)
    assert_openai_error(post(server, "wrong"), 401)
    assert_openai_error(post(server, KEY_A, priority=-10), 403, "alpha", "-5")
    assert_openai_error(post(server, KEY_B, priority=-1), 403, "beta", "bound is 0")
    assert post(server, KEY_A, priority=-5).status_code == 200
    assert post(server, KEY_B).status_code == 200


def test_a_deadline_passed_in_the_queue_is_a_504(server) -> None:
    """beta's request waits behind alpha's running one (one sequence at a time, alpha's
    priority better): its 1 ms deadline passes before anything is computed for it."""
    first_token = threading.Event()

    def stream_alpha() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True,
                "priority": -5, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY_A}"}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_token.set()

    alpha = threading.Thread(target=stream_alpha)
    alpha.start()
    assert first_token.wait(60), server.log_tail()
    assert_openai_error(post(server, KEY_B, deadline_ms=1, max_tokens=200), 504, "deadline")
    alpha.join()


def test_sighup_reloads_without_dropping_a_request(server, tenants_path) -> None:
    result: dict[str, httpx.Response] = {}
    long = threading.Thread(target=lambda: result.setdefault(
        "long", post(server, KEY_A, max_tokens=48, ignore_eos=True, priority=-5)))
    long.start()
    time.sleep(0.5)
    tenants_path.write_text(tenants_yaml(-2))
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "tenants reloaded" not in server.log_tail(20000):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
    assert_openai_error(post(server, KEY_A, priority=-5), 403, "bound is -2")
    long.join()
    response = result["long"]
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 48
    tenants_path.write_text("tenants: [")  # a broken file: the old tenants stay
    server.proc.send_signal(signal.SIGHUP)
    while "not reloaded" not in server.log_tail(20000):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
    assert post(server, KEY_A, priority=-2).status_code == 200
    log = server.log_tail(10**7)
    assert KEY_A not in log and KEY_B not in log
