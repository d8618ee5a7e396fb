"""`pagedserve bench`: the load generator's flags, the BenchConfig they make, and the run.

server/cli.py adds these flags as its `bench` subcommand and hands the parsed flags to
`run`. The flags that draw the requests (`add_load_arguments`) are also the workshop's
in-process engine loop's (bench/engine_loop.py), so that both run the same requests.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from loadgen import client
from loadgen.client import BenchConfig
from loadgen.workloads import WORKLOADS

# NOTE: the server's --api-key reads the same variable, so a shell that set it for
# `pagedserve serve` can load-test it as it is.
API_KEY_ENV = "PAGEDSERVE_API_KEY"


def parse_length_range(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "64:256" -> (64, 256)."""
    try:
        low, _, high = text.partition(":")
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length or LOW:HIGH range: {text!r}") from None


def parse_priority_mix(text: str) -> tuple[tuple[int, float], ...]:
    """"10:0.9,-10:0.1" -> ((10, 0.9), (-10, 0.1)); a missing weight is 1."""
    try:
        return tuple(
            (int(priority), float(weight or 1.0))
            for priority, _, weight in (part.partition(":") for part in text.split(","))
        )
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a priority mix: {text!r}") from None


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that draw the requests (`client.make_items`): how many, how many in
    flight, their prompts and lengths, sampling, and the output's form."""
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in flight at most (default 8 without --request-rate)")
    parser.add_argument("--input-len", type=parse_length_range, default=(128, 128),
                        help="prompt tokens (or words): N or LOW:HIGH (default 128)")
    parser.add_argument("--output-len", type=parse_length_range, default=(64, 64),
                        help="max_tokens: N or LOW:HIGH (default 64)")
    parser.add_argument("--prompt-token-ids", action=argparse.BooleanOptionalAction,
                        default=True, help="send token-id prompts (else random words)")
    parser.add_argument("--token-id-range", type=parse_length_range, default=(1000, 20000),
                        help="LOW:HIGH of the random prompt token ids")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly max_tokens (server extension)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def load_fields(args: argparse.Namespace) -> dict[str, Any]:
    """BenchConfig's fields from `add_load_arguments`' parsed flags."""
    return dict(
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        prompt_token_ids=args.prompt_token_ids,
        token_id_range=args.token_id_range,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        json=args.json,
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagedserve bench`."""
    parser.add_argument("--url", default=None,
                        help="server base URL, e.g. http://host:8000 (required)")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None)
    add_load_arguments(parser)
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Poisson arrivals per second (default: as fast as --concurrency)")
    parser.add_argument("--priority-mix", type=parse_priority_mix, default=None,
                        help='priority:weight pairs, e.g. "10:0.9,-10:0.1"')
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--http-client", choices=("httpx", "raw"), default="httpx",
                        help="raw: plain asyncio connections, a fraction of httpx's CPU per "
                        "streamed line (http:// only)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="ask N logprobs a token: every token then comes in a chunk of "
                        "its own, so TTFT and ITL time tokens, also those whose text is "
                        "held back (a character's first byte)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                        help="a fixed workload of docs/benchmarks.md (overrides the length, "
                        "count and priority flags)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="scale the workload's request count")


def build_bench_config(args: argparse.Namespace) -> BenchConfig:
    """The bench config from parsed `bench` flags; ValueError on invalid values."""
    if args.url is None:
        raise ValueError("--url is required")
    return BenchConfig(
        url=args.url,
        model=args.model,
        api_key=args.api_key,
        request_rate=args.request_rate,
        priority_mix=args.priority_mix,
        timeout_s=args.timeout,
        workload=args.workload,
        scale=args.scale,
        http_client=args.http_client,
        logprobs=args.logprobs,
        **load_fields(args),
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run `pagedserve bench` from its parsed flags: the load against --url; 1 if any
    request failed. Invalid flags end in `parser.error` (exit 2)."""
    try:
        config = build_bench_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    return client.run(config)
