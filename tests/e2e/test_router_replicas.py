"""The replicas recipe of docs/deployment.md on 127.0.0.1: two `pagedserve serve` behind
vllm-router's cache-aware policy. `priority` reaches the replicas, a repeated long prefix
sticks to one replica, and a killed replica drops out while the router keeps serving."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model
from tests.support.metrics import metric
from tests.support.server_process import ServerProcess as BaseServerProcess
from tests.support.server_process import free_port

SIM_FLAGS = ("--simulate-step-ms", "5", "--scheduling-policy", "priority",
             "--num-kv-blocks", "256")


def router_binary() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not Path(found).exists():
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    return found


@pytest.fixture
def replicas_and_router():
    _require_default_model()
    binary = router_binary()
    replicas = [ServerProcess(*SIM_FLAGS) for _ in range(2)]
    port = free_port()
    router = BaseServerProcess(
        command=[binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                 "--worker-urls", *(r.url for r in replicas), "--health-check-endpoint",
                 "/health", "--health-check-interval-secs", "1",
                 "--health-failure-threshold", "1"],
        port=port, log_prefix="vllm-router-",
    )
    router.wait_healthy(60)
    yield router.url, replicas
    router.terminate(10)
    router.remove_log()
    for replica in replicas:
        if replica.proc.poll() is None:
            replica.stop()
        else:
            replica.remove_log()


def test_replicas_behind_vllm_router(replicas_and_router) -> None:
    url, replicas = replicas_and_router

    def post(prompt: str, **body) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 2, **body})

    assert post("an urgent one", priority=-7).status_code == 200
    urgent = [metric(r, "pagedserve_request_queue_time_seconds_count", priority="-7")
              for r in replicas]
    assert sum(urgent) == 1, urgent  # the field reached the replica that ran it

    prefix = " ".join(f"word{i}" for i in range(300))
    for i in range(6):
        assert post(f"{prefix} question {i}").status_code == 200
    served = [metric(r, "pagedserve_request_success_total") for r in replicas]
    sticky = max(range(2), key=lambda i: served[i])
    assert served[sticky] >= 6, served  # the repeated prefix stayed on one replica

    replicas[sticky].proc.kill()
    replicas[sticky].proc.wait()
    time.sleep(3)  # the router's health checks notice
    results = [post(f"after the kill {i}").status_code for i in range(6)]
    assert results == [200] * 6, results
    other = replicas[1 - sticky]
    assert metric(other, "pagedserve_request_success_total") >= served[1 - sticky] + 6
