"""`pagedserve bench`: a load generator for any OpenAI-compatible completions server.

Sends streaming /v1/completions requests, either with a fixed number in flight
(--concurrency) or arriving as a Poisson process (--request-rate), and prints the
throughput plus time to first token, inter-token latency (between streamed chunks) and
time per output token (p50/p90/p99), per priority when --priority-mix is given. Prompts
are random token ids (default) or random words.

    pagedserve bench --url http://127.0.0.1:8000 --num-requests 64 --concurrency 16 \
        --input-len 64:256 --output-len 64 --priority-mix "10:0.9,-10:0.1"
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import uvloop

from loadgen.workloads import WORKLOADS, BenchItem

_WORDS = (
    "the of and to in is was for on that with as by at from his her are be this have "
    "not but had they which one you were all we can has there their been if more when "
    "will would who so no time about out up them into some could then other than its "
    "only new over also first two like any may after most these where many through "
    "before much each well should because very long even under great again same world "
    "small large number water river city house music paper light early point state"
).split()
_PERCENTILES = (50, 90, 99)



@dataclass
class Result:
    priority: int
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    num_chunks: int = 0


@dataclass(frozen=True)
class BenchConfig:
    """One load run. input_len / output_len / token_id_range are inclusive (low, high)
    ranges; priority_mix lists (priority, weight) pairs (None: no priority field sent);
    concurrency None means 8 without a request rate, unlimited with one."""

    url: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    num_requests: int = 64
    concurrency: int | None = None
    request_rate: float | None = None
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (64, 64)
    prompt_token_ids: bool = True
    token_id_range: tuple[int, int] = (1000, 20000)
    priority_mix: tuple[tuple[int, float], ...] | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    json: bool = False
    workload: str | None = None  # a name from loadgen.workloads: its requests and concurrency
    scale: float = 1.0  # scales the workload's request count
    http_client: str = "httpx"  # or "raw": plain asyncio connections (http:// only)
    # None: no logprobs asked. N: N top logprobs a token, so every token comes in a chunk
    # of its own (text or not), and TTFT and ITL time tokens, not printable text
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request_rate must be > 0")
        for name in ("input_len", "output_len", "token_id_range"):
            low, high = getattr(self, name)
            if not 0 <= low <= high or (name != "token_id_range" and low < 1):
                raise ValueError(f"{name} must be a range 1 <= low <= high")
        if self.priority_mix is not None and (
            not self.priority_mix or any(w <= 0 for _, w in self.priority_mix)
        ):
            raise ValueError("priority_mix weights must be > 0")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.workload is not None and self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}")
        if self.scale <= 0:
            raise ValueError("scale must be > 0")
        if self.http_client not in ("httpx", "raw"):
            raise ValueError("http_client must be httpx or raw")
        if self.http_client == "raw" and self.url.startswith("https:"):
            raise ValueError("the raw HTTP client speaks plain http:// only")


def make_items(config: BenchConfig) -> list[BenchItem]:
    rng = random.Random(config.seed)
    items = []
    for _ in range(config.num_requests):
        input_len = rng.randint(*config.input_len)
        prompt: str | list[int]
        if config.prompt_token_ids:
            prompt = [rng.randint(*config.token_id_range) for _ in range(input_len)]
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(input_len))
        priority = 0
        if config.priority_mix:
            priorities, weights = zip(*config.priority_mix, strict=True)
            priority = rng.choices(priorities, weights)[0]
        items.append(BenchItem(prompt, rng.randint(*config.output_len), priority))
    return items


async def _send(
    client: httpx.AsyncClient, config: BenchConfig, model: str, item: BenchItem
) -> Result:
    payload: dict[str, Any] = {
        "model": item.model or model,
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    if item.priority:
        payload["priority"] = item.priority
    if config.logprobs is not None:
        payload["logprobs"] = config.logprobs
    result = Result(item.priority)
    start = time.perf_counter()
    try:
        if config.http_client == "raw":
            status, lines = await _raw_stream(config, payload)
            if status != 200:
                result.error = f"HTTP {status}: {''.join([x async for x in lines])[:200]}"
                return result
            await _read_events(lines, result, start)
        else:
            async with client.stream("POST", "/v1/completions", json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {body[:200]}"
                    return result
                await _read_events(response.aiter_lines(), result, start)
    except (httpx.HTTPError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if result.error is not None:
        return result
    result.latency_s = time.perf_counter() - start
    if not result.output_tokens:  # the server sent no usage: count content chunks
        result.output_tokens = result.num_chunks
        result.prompt_tokens = len(item.prompt) if isinstance(item.prompt, list) else 0
    result.ok = True
    return result


async def _read_events(lines: AsyncIterator[str], result: Result, start: float) -> None:
    """Reads an SSE stream into `result` (usage, TTFT, inter-chunk times, or its error).
    A chunk times a token when it has text, or logprobs (a token whose text is held back,
    e.g. the first byte of a character, comes with its logprobs and no text)."""
    last = start
    async for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = orjson.loads(line[len("data: "):])
        if "error" in chunk:
            result.error = str(chunk["error"].get("message"))
            return
        if chunk.get("usage"):
            result.prompt_tokens = chunk["usage"]["prompt_tokens"]
            result.output_tokens = chunk["usage"]["completion_tokens"]
        choice = chunk["choices"][0] if chunk.get("choices") else None
        if choice and (choice.get("text") or (choice.get("logprobs") or {}).get("tokens")):
            now = time.perf_counter()
            if result.ttft_s is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.num_chunks += 1


async def _raw_stream(
    config: BenchConfig, payload: dict[str, Any]
) -> tuple[int, AsyncIterator[str]]:
    """POST /v1/completions on a plain asyncio connection (HTTP/1.1, one request per
    connection): the status and the body's lines. A fraction of httpx's cost per line,
    so that the load generator is not what a fast server is measured by."""
    url = urllib.parse.urlsplit(config.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    body = orjson.dumps(payload)
    auth = f"Authorization: Bearer {config.api_key}\r\n" if config.api_key else ""
    head = (f"POST {url.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{auth}"
            "Connection: close\r\n\r\n")
    reader, writer = await asyncio.open_connection(host, port, limit=2**20)
    writer.write(head.encode() + body)
    status = int((await reader.readline()).split()[1])
    chunked, length = False, None
    while (header := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = header.decode("latin-1").partition(":")
        if name.lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
        elif name.lower() == "content-length":
            length = int(value)

    async def lines() -> AsyncIterator[str]:
        try:
            pending = b""
            while True:
                if chunked:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    data = (await reader.readexactly(size + 2))[:-2] if size else b""
                else:
                    data = await (reader.readexactly(length) if length else reader.read())
                if not data:
                    break
                pending += data
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.decode()
                if not chunked:
                    break
            if pending:
                yield pending.decode()
        finally:
            writer.close()

    return status, lines()


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run the load of the flags (or of --workload) and return the summary."""
    if config.workload is not None:
        workload = WORKLOADS[config.workload](config.scale, config.seed)
        # NOTE: workloads measure fixed lengths: every output runs to its max_tokens.
        config = dataclasses.replace(config, ignore_eos=True)
        concurrency = config.concurrency or workload.concurrency
        return await run_items(config, workload.requests, concurrency)
    concurrency = config.concurrency or (8 if config.request_rate is None else config.num_requests)
    return await run_items(config, make_items(config), concurrency)


async def run_items(
    config: BenchConfig, items: Sequence[BenchItem], concurrency: int
) -> dict[str, Any]:
    """Send `items`: at most `concurrency` in flight (or Poisson arrivals at
    config.request_rate); items with a `send_at_s` go at that offset, outside the gate."""
    limits = httpx.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with httpx.AsyncClient(
        base_url=config.url.rstrip("/"), timeout=config.timeout_s, limits=limits, headers=headers
    ) as client:
        model = config.model or await _first_model(client)
        gate = asyncio.Semaphore(concurrency)
        rng = random.Random(config.seed + 1)

        async def gated(item: BenchItem) -> Result:
            async with gate:
                return await _send(client, config, model, item)

        async def timed(item: BenchItem, at: float) -> Result:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            return await _send(client, config, model, item)

        start = time.perf_counter()
        tasks = []
        for item in items:
            if item.send_at_s is not None:
                tasks.append(asyncio.create_task(timed(item, item.send_at_s)))
                continue
            tasks.append(asyncio.create_task(gated(item)))
            if config.request_rate is not None:
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, model)


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for p in _PERCENTILES:
        if not ordered:
            out[f"p{p}"] = None
            continue
        k = (len(ordered) - 1) * p / 100
        low, high = math.floor(k), math.ceil(k)
        out[f"p{p}"] = ordered[low] + (ordered[high] - ordered[low]) * (k - low)
    return out


def time_per_output_token(result: Result) -> float | None:
    """TPOT: a request's time per output token after its first (None with one token). A
    chunk's ITL is a step, which may carry several tokens (speculative decoding, a stream
    interval); TPOT counts tokens."""
    if result.ttft_s is None or result.output_tokens < 2:
        return None
    return (result.latency_s - result.ttft_s) / (result.output_tokens - 1)


def _latency_stats(results: Sequence[Result]) -> dict[str, Any]:
    tpots = [t for t in map(time_per_output_token, results) if t is not None]
    return {
        "num_requests": len(results),
        "output_tokens": sum(r.output_tokens for r in results),
        "ttft_s": _percentiles([r.ttft_s for r in results if r.ttft_s is not None]),
        "itl_s": _percentiles([x for r in results for x in r.itl_s]),
        "tpot_s": _percentiles(tpots),
    }


def summarize(results: Sequence[Result], duration_s: float, model: str) -> dict[str, Any]:
    """Throughput over the run, latency percentiles overall and per priority."""
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "model": model,
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "all": _latency_stats(ok),
        "by_priority": {
            str(p): _latency_stats([r for r in ok if r.priority == p])
            for p in sorted({r.priority for r in ok})
        },
    }


def _ms(stats: dict[str, float | None]) -> str:
    return "/".join("-" if v is None else f"{v * 1000:.1f}" for v in stats.values())


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"model {summary['model']}: {summary['num_requests'] - summary['num_failed']} ok, "
        f"{summary['num_failed']} failed in {summary['duration_s']:.2f} s "
        f"({summary['request_throughput']:.2f} req/s)",
        f"throughput: total {summary['total_token_throughput']:.1f} tok/s, "
        f"output {summary['output_token_throughput']:.1f} tok/s "
        f"({summary['prompt_tokens']} prompt + {summary['output_tokens']} output tokens)",
        f"{'priority':>8} {'n':>5}  {'TTFT p50/p90/p99 ms':>24}  {'ITL p50/p90/p99 ms':>22}"
        f"  {'TPOT p50/p90/p99 ms':>22}",
    ]
    rows = [("all", summary["all"])]
    if len(summary["by_priority"]) > 1:
        rows += list(summary["by_priority"].items())
    for name, stats in rows:
        lines.append(f"{name:>8} {stats['num_requests']:>5}  {_ms(stats['ttft_s']):>24}  "
                     f"{_ms(stats['itl_s']):>22}  {_ms(stats['tpot_s']):>22}")
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


def run(config: BenchConfig) -> int:
    """Run the load, print the summary; 1 if any request failed."""
    summary = uvloop.run(run_bench(config))
    print(json.dumps(summary, indent=2) if config.json else format_summary(summary))
    return 1 if summary["num_failed"] else 0
