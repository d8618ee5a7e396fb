"""The load generator (loadgen/client.py, both HTTP clients) against a real uvicorn server
in a thread over a scripted engine, without a model: summaries, errors, logprobs, text
prompts and a request rate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from loadgen.cli import build_bench_config
from loadgen.client import BenchConfig, Result, _send, format_summary, run_bench, run_items
from loadgen.workloads import BenchItem
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from server.cli import build_parser
from tests.conftest import ScriptedRunner
from tests.support.live_server import LiveServer


class PacedRunner(ScriptedRunner):
    """The scripted runner, each step taking `step_s` as a device's would."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.step_s)
        return super().execute(plan)


@pytest.fixture
def live(make_fake_engine, live_servers) -> Callable[..., LiveServer]:
    def make(policy: str = "fcfs", step_s: float = 0.0) -> LiveServer:
        runner = PacedRunner(step_s) if step_s else None
        return live_servers(make_fake_engine(policy=policy, runner=runner, start=False))

    return make


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


def test_an_item_names_its_own_model(live) -> None:
    # a LoRA benchmark spreads one run's requests over adapters, each named in `model`
    server = live()
    config = BenchConfig(url=server.url, ignore_eos=True)
    items = [BenchItem([65, 66], 3), BenchItem([65, 66], 3, model="an-adapter")]
    summary = asyncio.run(run_items(config, items, 2))
    assert summary["model"] == "fake-model"
    assert summary["num_failed"] == 1
    assert "HTTP 404" in summary["errors"][0] and "an-adapter" in summary["errors"][0]
