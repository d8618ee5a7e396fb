"""A bounded soak test of a pagedserve server, on the loopback interface only.

    python -m bench.soak --duration 120            # starts a server on a free port
    python -m bench.soak --url http://127.0.0.1:8000 --pid 1234 --duration 600

Keeps --concurrency requests in flight for --duration seconds: completions and chat,
streaming and not, mixed priorities, clients that hang up mid-stream or give up waiting,
and bad requests (each must be refused in OpenAI's error shape). At the end it waits for
the server to go idle and reports the requests served, the outcomes and errors by kind,
the KV blocks still held, the scheduler's integrity check and the growth of the server's
resident memory (VmRSS) from the end of the warm-up to the end. Exit status 0 when there
was no error, no block is held and the growth is under --max-rss-growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.support.server_process import ServerProcess, read_rss_kib

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_WORDS = (
    "the river city house music paper light early point state small large number water "
    "world great again same long even under very because should well each much before "
    "through many where these most after may any like two first also over new only its "
    "than other then could some into them up out about time no so who would will when"
).split()
_PRIORITIES = (-5, 0, 0, 5, 10)
# (kind, weight): what each client does next
_KINDS = (
    ("complete", 20), ("stream", 20), ("chat", 10), ("chat_stream", 10),
    ("vanish", 12), ("timeout", 10), ("bad", 18),
)
DEFAULT_SERVER_ARGS = (
    "--scheduling-policy priority --num-kv-blocks 128 --block-size 16 "
    "--max-num-seqs 32 --max-num-batched-tokens 512"
)


@dataclass
class SoakStats:
    outcomes: Counter[str] = field(default_factory=Counter)  # expected ends, by kind
    errors: Counter[str] = field(default_factory=Counter)  # anything else, by kind
    error_examples: dict[str, str] = field(default_factory=dict)
    output_tokens: int = 0

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.error_examples.setdefault(kind, detail[:300])


class SoakError(Exception):
    """A response that breaks the contract (kind, detail)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


# ------------------------------------------------------------------ the clients


def _prompt(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def _bad_request(rng: random.Random, context: int) -> tuple[str, bytes, int]:
    """(path, body, expected status) of a request the server must refuse."""
    cases = [
        ("/v1/completions", b'{"prompt": "hi", ', 400),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "many"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "temperature": 9}', 400),
        ("/v1/completions", b'{"prompt": "hi", "n": 1000}', 400),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}', 400),
        ("/v1/completions", b'{"prompt": "hi", "model": "no-such-model"}', 404),
        ("/v1/completions",
         json.dumps({"prompt": [7] * (context + 1), "max_tokens": 1}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "x " * (context * 200)}).encode(), 400),
        ("/v1/completions", b"[" * 50_000 + b"]" * 50_000, 400),
        ("/v1/completions", b'{"prompt": "\\ud800"}', 400),
        ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [100000000], '
                            b'"min_tokens": 2}', 400),
        ("/v1/chat/completions", b'{"messages": []}', 400),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400),
    ]
    return rng.choice(cases)


def _check_error(response: httpx.Response, expected: int | None = None) -> None:
    if response.status_code >= 500:
        raise SoakError(f"http {response.status_code}", response.text)
    if expected is not None and response.status_code != expected:
        raise SoakError(f"http {response.status_code} (wanted {expected})", response.text)
    try:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    except Exception:
        raise SoakError("error not in OpenAI's shape", response.text) from None


async def _stream(client: httpx.AsyncClient, path: str, body: dict, rng: random.Random,
                  vanish_after: int | None, stats: SoakStats) -> str:
    """Reads an SSE stream to [DONE] (or hangs up after `vanish_after` chunks)."""
    seen = 0
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            if response.status_code == 503:
                return "overloaded"
            _check_error(response)
            raise SoakError(f"http {response.status_code}", response.text)
        done = False
        async for line in response.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                raise SoakError("not an SSE data line", line)
            if done:
                raise SoakError("data after [DONE]", line)
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise SoakError("error event in a stream", line)
            seen += 1
            stats.output_tokens += 1 if event.get("choices") else 0
            if vanish_after is not None and seen >= vanish_after:
                return "vanished"
        if not done:
            raise SoakError("stream ended without [DONE]", f"{seen} chunks")
    return "ok"


async def _one(client: httpx.AsyncClient, rng: random.Random, context: int,
               stats: SoakStats) -> str:
    kind = rng.choices([k for k, _ in _KINDS], weights=[w for _, w in _KINDS])[0]
    priority = rng.choice(_PRIORITIES)
    max_tokens = rng.randint(4, 32)
    completion = {"prompt": _prompt(rng, 3, 40), "max_tokens": max_tokens,
                  "priority": priority, "temperature": rng.choice([0.0, 0.7])}
    chat = {"messages": [{"role": "user", "content": _prompt(rng, 3, 20)}],
            "max_tokens": max_tokens, "priority": priority}
    if kind == "bad":
        path, content, expected = _bad_request(rng, context)
        response = await client.post(path, content=content,
                                     headers={"content-type": "application/json"})
        _check_error(response, expected)
        return "refused"
    if kind == "timeout":
        try:
            response = await client.post("/v1/completions", json=completion,
                                         timeout=rng.uniform(0.05, 2.0))
        except httpx.TimeoutException:
            return "gave up"
        kind = "complete"
    elif kind in ("complete", "chat"):
        path = "/v1/completions" if kind == "complete" else "/v1/chat/completions"
        response = await client.post(path, json=completion if kind == "complete" else chat)
    else:
        path = "/v1/chat/completions" if kind == "chat_stream" else "/v1/completions"
        body = chat if kind == "chat_stream" else completion
        vanish_after = rng.randint(0, max_tokens) if kind == "vanish" else None
        outcome = await _stream(client, path, body, rng, vanish_after, stats)
        return {"ok": "streamed", "vanished": "hung up", "overloaded": "503"}[outcome]
    if response.status_code == 503:
        _check_error(response)
        return "503"
    if response.status_code != 200:
        _check_error(response)
        raise SoakError(f"http {response.status_code}", response.text)
    usage = response.json()["usage"]
    stats.output_tokens += usage["completion_tokens"]
    return "completed"


async def _worker(url: str, headers: dict, deadline: float, seed: int, context: int,
                  stats: SoakStats, request_timeout_s: float) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=request_timeout_s,
                                 limits=limits) as client:
        while time.monotonic() < deadline:
            try:
                stats.outcomes[await _one(client, rng, context, stats)] += 1
            except SoakError as exc:
                stats.error(exc.kind, exc.detail)
            except httpx.HTTPError as exc:
                stats.error(type(exc).__name__, repr(exc))
            except Exception as exc:
                stats.error(type(exc).__name__, repr(exc))


# ------------------------------------------------------------------ the run


async def _wait_idle(url: str, headers: dict, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as client:
        while True:
            state = (await client.get("/scheduler/state")).json()
            if (not state["running"] and not state["waiting"]) or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.2)


async def soak(url: str, pid: int | None, args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as client:
        context = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
    stats = SoakStats()
    start = time.monotonic()
    deadline = start + args.duration
    warmup_s = args.warmup if args.warmup is not None else min(30.0, args.duration / 4)
    workers = [
        asyncio.create_task(_worker(url, headers, deadline, args.seed * 1000 + i, context,
                                    stats, args.request_timeout))
        for i in range(args.concurrency)
    ]
    await asyncio.sleep(warmup_s)
    rss_warm = read_rss_kib(pid) if pid else None
    rss_peak = rss_warm or 0
    while not all(w.done() for w in workers):
        await asyncio.sleep(1.0)
        rss = read_rss_kib(pid) if pid else None
        rss_peak = max(rss_peak, rss or 0)
        if args.progress and int(time.monotonic() - start) % 15 == 0:
            print(f"  t={time.monotonic() - start:5.0f}s served={sum(stats.outcomes.values())} "
                  f"errors={sum(stats.errors.values())} rss={rss}KiB", file=sys.stderr)
    await asyncio.gather(*workers)
    load_s = time.monotonic() - start
    state = await _wait_idle(url, headers, timeout_s=30)
    await asyncio.sleep(1.0)  # let the engine go idle (it checks integrity then)
    rss_end = read_rss_kib(pid) if pid else None
    kv = state["kv_cache"]
    report: dict[str, Any] = {
        "url": url,
        "duration_s": round(load_s, 1),
        "concurrency": args.concurrency,
        "requests": sum(stats.outcomes.values()) + sum(stats.errors.values()),
        "served": sum(v for k, v in stats.outcomes.items() if k != "refused"),
        "outcomes": dict(stats.outcomes.most_common()),
        "errors": dict(stats.errors.most_common()),
        "error_examples": stats.error_examples,
        "output_tokens_seen": stats.output_tokens,
        "end_state": {
            "running": len(state["running"]),
            "waiting": len(state["waiting"]),
            "blocks_held": kv["num_blocks"] - kv["num_free_blocks"],
            "num_blocks": kv["num_blocks"],
            "kv_usage": kv["usage"],
            "integrity": state.get("integrity", "unknown"),
            "num_preemptions_total": state.get("num_preemptions_total"),
        },
        "rss_kib": {"after_warmup": rss_warm, "peak": rss_peak or None, "end": rss_end},
    }
    if rss_warm and rss_end:
        report["rss_growth_pct"] = round(100.0 * (rss_end - rss_warm) / rss_warm, 2)
    return report


def _passed(report: dict[str, Any], max_rss_growth_pct: float) -> bool:
    end = report["end_state"]
    growth = report.get("rss_growth_pct")
    return (
        not report["errors"]
        and end["running"] == 0 and end["waiting"] == 0 and end["blocks_held"] == 0
        and end["integrity"] in ("ok", "unknown")
        and (growth is None or growth < max_rss_growth_pct)
    )


def _format(report: dict[str, Any]) -> str:
    end, rss = report["end_state"], report["rss_kib"]
    lines = [
        f"soak of {report['url']}: {report['duration_s']} s at {report['concurrency']} in flight",
        f"  requests {report['requests']}, served {report['served']}, "
        f"output tokens seen {report['output_tokens_seen']}",
        "  outcomes: " + ", ".join(f"{k} {v}" for k, v in report["outcomes"].items()),
        "  errors: " + (", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "none"),
    ]
    for kind, example in report["error_examples"].items():
        lines.append(f"    e.g. {kind}: {example}")
    lines += [
        f"  at the end: {end['running']} running, {end['waiting']} waiting, "
        f"{end['blocks_held']}/{end['num_blocks']} KV blocks held, integrity {end['integrity']}, "
        f"{end['num_preemptions_total']} preemptions in all",
        f"  server RSS: {rss['after_warmup']} KiB after warm-up, peak {rss['peak']}, "
        f"end {rss['end']} ({report.get('rss_growth_pct', '?')}% growth)",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the first RSS reading (default: a quarter of "
                        "the duration, at most 30)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--url", default=None,
                        help="a running server on the loopback (default: start one)")
    parser.add_argument("--pid", type=int, default=None,
                        help="with --url: the server's pid, to read its RSS")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                        help=f"flags of the started server (default: {DEFAULT_SERVER_ARGS!r})")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY") or None)
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a normal request may take")
    parser.add_argument("--max-rss-growth", type=float, default=5.0,
                        help="percent of RSS growth after warm-up that fails the run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--progress", action="store_true", help="a line every 15 s")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.duration <= 0 or args.concurrency < 1:
        raise SystemExit("--duration must be > 0 and --concurrency >= 1")
    server: ServerProcess | None = None
    if args.url is not None:
        host = urlsplit(args.url).hostname
        if host not in _LOOPBACK:
            raise SystemExit(f"--url must be on the loopback interface, not {host!r}")
        url, pid = args.url.rstrip("/"), args.pid
    else:
        # NOTE: the key travels in the environment, not on the command line.
        env = {"PAGEDSERVE_API_KEY": args.api_key} if args.api_key else None
        server = ServerProcess(args.server_args.split(), env=env, log_prefix="pagedserve-soak-")
        print(f"starting a server ({args.server_args}); log: {server.log.name}",
              file=sys.stderr)
        try:
            server.wait_healthy()
        except RuntimeError:
            server.terminate()
            raise
        url, pid = server.url, server.pid
    try:
        report = asyncio.run(soak(url, pid, args))
    finally:
        if server is not None:
            returncode = server.terminate()
            print(f"server stopped with status {returncode}", file=sys.stderr)
    if server is not None:
        report["server_exit_status"] = returncode
    passed = _passed(report, args.max_rss_growth) and report.get("server_exit_status", 0) == 0
    report["passed"] = passed
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
