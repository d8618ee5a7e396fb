"""`pagedserve bench` flags -> the load generator's BenchConfig (loadgen/cli.py), and the
subcommand's dispatch from the `pagedserve` command."""

from __future__ import annotations

import argparse

import pytest

from loadgen.cli import build_bench_config, parse_length_range, parse_priority_mix
from server import cli as server_cli
from server.cli import build_parser


def test_bench_flags_build_a_bench_config() -> None:
    args = build_parser().parse_args(
        ["bench", "--url", "http://x", "--input-len", "8:16", "--priority-mix", "10:0.9,-10:0.1",
         "--no-prompt-token-ids", "--request-rate", "2.5", "--timeout", "9"]
    )
    assert args.command == "bench"
    config = build_bench_config(args)
    assert (config.url, config.input_len, config.output_len) == ("http://x", (8, 16), (64, 64))
    assert config.priority_mix == ((10, 0.9), (-10, 0.1))
    assert not config.prompt_token_ids and config.request_rate == 2.5 and config.timeout_s == 9


@pytest.mark.parametrize(
    "flags", [["--input-len", "0"], ["--output-len", "9:3"], ["--priority-mix", "1:0"],
              ["--num-requests", "0"], ["--concurrency", "0"]],
)
def test_invalid_bench_values_raise_value_error(flags: list[str]) -> None:
    args = build_parser().parse_args(["bench", "--url", "http://x", *flags])
    with pytest.raises(ValueError):
        build_bench_config(args)


def test_range_and_mix_parsing() -> None:
    assert parse_length_range("7") == (7, 7) and parse_length_range("2:5") == (2, 5)
    assert parse_priority_mix("5") == ((5, 1.0),)
    for bad in ("a:b", "1:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_priority_mix(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_length_range("a:b")


def test_bench_engine_loop_needs_a_step_time_and_no_url() -> None:
    args = build_parser().parse_args(["bench", "--engine-loop", "--simulate-step-ms", "10"])
    assert build_bench_config(args).url == ""
    with pytest.raises(ValueError, match="--simulate-step-ms"):
        build_bench_config(build_parser().parse_args(["bench", "--engine-loop"]))
    with pytest.raises(ValueError, match="--url"):
        build_bench_config(build_parser().parse_args(["bench"]))

def test_engine_loop_runs_through_the_engine_loop_it_is_given(monkeypatch) -> None:
    """`pagedserve bench --engine-loop` reaches the engine's step loop with the flags' config,
    step time and overlap, and returns its exit status; without a step time it exits 2."""
    calls = []

    def engine_loop(config, step_ms: float, async_scheduling: bool) -> int:
        calls.append((config.num_requests, step_ms, async_scheduling))
        return 7

    monkeypatch.setattr(server_cli, "_bench_engine_loop", engine_loop)
    assert server_cli.main(["bench", "--engine-loop", "--simulate-step-ms", "2.5",
                            "--num-requests", "3", "--async-scheduling"]) == 7
    assert calls == [(3, 2.5, True)]
    with pytest.raises(SystemExit) as exc:
        server_cli.main(["bench", "--engine-loop"])
    assert exc.value.code == 2 and len(calls) == 1
