"""/metrics under vLLM's names, read as the Gateway API Inference Extension's endpoint picker
(llm-d's router) reads them: its default vLLM mapping is `vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc` and the labels `block_size` and
`num_gpu_blocks` of `vllm:cache_config_info`; of a name's series it takes the latest
(none carries a timestamp: the first)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.config import ServerConfig
from tests.support.engine_helpers import core_of, step_faults
from tests.support.metrics import metric_in
from tests.support.waits import wait_for

SEATS = 2
BODY = {"prompt": "hi", "max_tokens": 8}


@dataclass
class PickerView:
    """What the endpoint picker stores of one scrape."""

    waiting: int
    running: int
    kv_usage: float
    block_size: int
    num_gpu_blocks: int


def picker_scrape(text: str) -> PickerView:
    """The picker's reading of an exposition: each name's first series, by vLLM's names."""
    first = {family.name: family.samples[0] for family in text_string_to_metric_families(text)
             if family.samples}
    info = first["vllm:cache_config_info"]
    assert info.value == 1
    return PickerView(
        waiting=int(first["vllm:num_requests_waiting"].value),
        running=int(first["vllm:num_requests_running"].value),
        kv_usage=first["vllm:kv_cache_usage_perc"].value,
        block_size=int(info.labels["block_size"]),
        num_gpu_blocks=int(info.labels["num_gpu_blocks"]),
    )


@pytest.fixture
def served(make_fake_engine, open_client):
    engine = make_fake_engine(max_num_seqs=SEATS, num_blocks=64, block_size=4, start=False)
    return open_client(engine, ServerConfig()), engine


def test_vllm_names_and_labels_when_idle(served) -> None:
    client, _ = served
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        assert f'{name}{{engine="0",model_name="fake-model"}} 0.0' in text
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info")]
    assert info == ['vllm:cache_config_info{block_size="4",enable_prefix_caching="True",'
                    'engine="0",num_gpu_blocks="64"} 1.0']


def test_a_picker_scrape_follows_seats_filled_then_idle(served) -> None:
    """Four requests for two seats: held with both seats running and two waiting, the
    picker reads waiting 2, running 2 and a usage in (0, 1], the same as our own series;
    once they finish, zeros."""
    client, engine = served
    core = core_of(engine)
    first_step, go, held, release = (threading.Event() for _ in range(4))
    full_steps = 0

    def hold(plan) -> None:
        """Holds the first step until every request is sent; then, once a step has run
        with both seats taken and two waiting (its stats sent), holds the next one."""
        nonlocal full_steps
        if not first_step.is_set():
            first_step.set()
            assert go.wait(30)
            return
        scheduler = core.scheduler
        if len(scheduler.running) == SEATS and scheduler.num_waiting == 2:
            full_steps += 1
            if full_steps == 2:
                held.set()
                assert release.wait(30)

    step_faults(core).on_launch = hold
    statuses: list[int] = []

    def send() -> None:
        statuses.append(client.post("/v1/completions", json=BODY).status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    threads[0].start()
    assert first_step.wait(15)
    wait_for(lambda: engine.num_waiting == 0, "the first request taken in")
    for thread in threads[1:]:
        thread.start()
    wait_for(lambda: engine.num_waiting == 3, "the three others sent to the held core")
    go.set()
    assert held.wait(15)
    wait_for(lambda: picker_scrape(client.get("/metrics").text).waiting == 2,
             "the stats of the step before the held one")
    text = client.get("/metrics").text
    view = picker_scrape(text)
    assert (view.waiting, view.running) == (2, SEATS)
    assert 0 < view.kv_usage <= 1
    assert (view.block_size, view.num_gpu_blocks) == (4, 64)
    assert view.kv_usage == metric_in(text, "pagedserve_kv_cache_usage_perc")
    assert view.waiting == metric_in(text, "pagedserve_num_requests_waiting")
    assert view.running == metric_in(text, "pagedserve_num_requests_running")

    step_faults(core).on_launch = None
    release.set()
    for thread in threads:
        thread.join(30)
    assert statuses == [200] * 4
    wait_for(lambda: picker_scrape(client.get("/metrics").text).running == 0, "idle")
    idle = picker_scrape(client.get("/metrics").text)
    assert (idle.waiting, idle.running, idle.kv_usage) == (0, 0, 0.0)
