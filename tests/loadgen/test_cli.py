"""`pagedserve bench` flags -> the load generator's BenchConfig (loadgen/cli.py), and the
subcommand's dispatch from the `pagedserve` command."""

from __future__ import annotations

import argparse

import pytest

from loadgen import client
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


def test_bench_needs_a_url() -> None:
    with pytest.raises(ValueError, match="--url"):
        build_bench_config(build_parser().parse_args(["bench"]))


def test_pagedserve_bench_runs_the_load_generator(monkeypatch) -> None:
    """`pagedserve bench` hands the flags' config to the load generator and returns its
    exit status; without --url it exits 2, and the in-process engine loop is the
    workshop's (bench/engine_loop.py), not a flag of the shipped command."""
    calls = []

    def run(config) -> int:
        calls.append((config.url, config.num_requests))
        return 7

    monkeypatch.setattr(client, "run", run)
    assert server_cli.main(["bench", "--url", "http://x", "--num-requests", "3"]) == 7
    assert calls == [("http://x", 3)]
    for argv in (["bench"], ["bench", "--url", "http://x", "--engine-loop"]):
        with pytest.raises(SystemExit) as exc:
            server_cli.main(argv)
        assert exc.value.code == 2 and len(calls) == 1
