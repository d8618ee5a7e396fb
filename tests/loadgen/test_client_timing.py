"""The load generator's clock: which streamed chunks time a token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from loadgen.cli import build_bench_config
from loadgen.client import BenchConfig, Result, _read_events, summarize, time_per_output_token
from server.cli import build_parser


def sse(*choices: dict) -> list[str]:
    return [f"data: {orjson.dumps({'choices': [c]}).decode()}" for c in choices] + [
        "data: [DONE]"
    ]


async def lines_of(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


def read(lines: list[str]) -> Result:
    result = Result(priority=0)
    asyncio.run(_read_events(lines_of(lines), result, start=0.0))
    return result


def test_a_token_with_held_back_text_is_timed_by_its_logprobs() -> None:
    """'é' as two byte tokens: the first comes with its logprobs and no text. Each of
    the three tokens is timed: TTFT, then two gaps, not one gap that spans two steps."""
    result = read(sse(
        {"index": 0, "text": "a", "logprobs": {"tokens": ["a"]}},
        {"index": 0, "text": "", "logprobs": {"tokens": ["bytes:\\xc3"]}},
        {"index": 0, "text": "é", "logprobs": {"tokens": ["bytes:\\xa9"]}},
    ))
    assert result.ttft_s is not None and len(result.itl_s) == 2 and result.num_chunks == 3


def test_without_logprobs_only_text_chunks_are_timed() -> None:
    result = read(sse({"index": 0, "text": "a"}, {"index": 0, "text": ""},
                      {"index": 0, "text": "é", "finish_reason": "length"}))
    assert len(result.itl_s) == 1 and result.num_chunks == 2


def test_bench_logprobs_flag() -> None:
    args = build_parser().parse_args(["bench", "--url", "http://x", "--logprobs", "0"])
    assert build_bench_config(args).logprobs == 0
    assert build_bench_config(build_parser().parse_args(["bench", "--url", "u"])).logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        BenchConfig(url="u", logprobs=-1)


def test_time_per_output_token_counts_tokens_not_chunks() -> None:
    """A speculating server streams several tokens a chunk: 9 tokens after the first in 3
    chunks of 0.3 s is 0.1 s a token (the chunks' ITL is 0.3 s); per priority, the output
    tokens add up for that priority's throughput."""
    spec = Result(priority=-1, ok=True, output_tokens=10, ttft_s=0.5, itl_s=[0.3] * 3,
                  latency_s=1.4)
    plain = Result(priority=1, ok=True, output_tokens=4, ttft_s=0.2, itl_s=[0.2] * 3,
                   latency_s=0.8)
    assert time_per_output_token(spec) == pytest.approx(0.1)
    assert time_per_output_token(Result(priority=0, ok=True, output_tokens=1, ttft_s=0.1)) \
        is None
    summary = summarize([spec, plain], 2.0, "m")
    assert summary["by_priority"]["-1"]["tpot_s"]["p50"] == pytest.approx(0.1)
    assert summary["by_priority"]["-1"]["itl_s"]["p50"] == pytest.approx(0.3)
    assert summary["by_priority"]["1"]["output_tokens"] == 4
    assert summary["all"]["tpot_s"]["p50"] == pytest.approx(0.15)
