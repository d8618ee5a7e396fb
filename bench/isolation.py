"""The hostile-client suite: what each attack gets, and what another tenant sees meanwhile.

Three tenants share one server: `attacker` sends each hostile request of ATTACKS while
`victim` streams short completions back to back. Per attack: the attacker's answer
against what is expected (a 4xx naming the limit and its flag, or served within bounds),
the victim's inter-token latency (p50/p99/max) and TTFT against the unattacked run of
the same server, /health latency, the RSS growth of the server's processes (the API
process and the engine core), the API process's CPU seconds, and the pool idle afterwards
(read by the `operator` tenant). `Measure.violations` holds the bounds the isolation
issue set: the victim's largest gap within max(1 s, 8x its unattacked median), /health
within 1 s, no process growing more than 400 MB, the pool idle.

`python -m bench.isolation` starts the default model with the tenants and the flags the
attacks need (SERVER_FLAGS), runs every attack, prints the table and can write JSON;
tests/e2e/test_isolation.py runs the same list against the same bounds.

An attack is one entry of ATTACKS: a route and a body (a callable for bodies too large to
build at import), or a small async function for the protocol-level ones, and what counts
as success (`refused(status, *needles)`, `served()`, `served_or_refused(...)`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.soak import read_rss_kib
from tests.support.server_process import ServerProcess, cpu_seconds
from tests.support.waits import wait_idle

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
KEYS = {"victim": "isolation-victim-key", "attacker": "isolation-attacker-key",
        "operator": "isolation-operator-key"}
ATTACKER_MAX_IN_FLIGHT = 4
BODY_TIMEOUT_S = 1.0
VOCAB_SIZE = 49152  # the default model's (SmolLM2)
MAX_ITL_S, ITL_FACTOR, MAX_HEALTH_S, MAX_RSS_GROWTH_MB = 1.0, 8.0, 1.0, 400.0

SERVER_FLAGS = (
    "--scheduling-policy", "priority", "--tool-call-parser", "hermes",
    "--body-timeout-s", str(BODY_TIMEOUT_S), "--num-kv-blocks", "512", "--max-num-seqs", "32",
    "--log-level", "warning",
)
VICTIM_BODY = {"prompt": "The history of the old harbour town begins", "max_tokens": 16,
               "ignore_eos": True, "temperature": 0, "stream": True}


def tenants_yaml() -> str:
    """The tenants file: the victim, the attacker (a few seats) and the operator (admin)."""
    lines = ["tenants:"]
    for name, key in KEYS.items():
        lines += [f"  - name: {name}",
                  f'    api_key_sha256: "{hashlib.sha256(key.encode()).hexdigest()}"']
        if name == "attacker":
            lines.append(f"    max_in_flight: {ATTACKER_MAX_IN_FLIGHT}")
        if name == "operator":
            lines.append("    admin: true")
    return "\n".join(lines) + "\n"


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


# ------------------------------------------------------------------ answers and expectations


@dataclass(frozen=True)
class Answer:
    """What the attacker got: every status (0: no answer, in time or at all), the error
    message of a refusal or of an error event in a stream, the finish reasons, and a
    violation the attack's own function found."""

    statuses: tuple[int, ...]
    message: str = ""
    finish_reasons: tuple[str, ...] = ()
    stream_error: str = ""
    violation: str = ""


@dataclass(frozen=True)
class Expect:
    """Success: every status in `statuses`; a refusal's message holds every needle; no
    error event in a served stream; `check(answer)` (a problem, or "") passes."""

    statuses: frozenset[int]
    needles: tuple[str, ...] = ()
    check: Callable[[Answer], str] | None = None

    def describe(self) -> str:
        codes = "/".join("served" if s == 200 else str(s) for s in sorted(self.statuses))
        return codes + (f" naming {', '.join(self.needles)}" if self.needles else "")

    def problem(self, answer: Answer) -> str:
        """Why `answer` is not a success ("" when it is)."""
        got = "/".join(str(s) for s in answer.statuses) or "nothing"
        message = " ".join(answer.message.split())[:160]
        if not answer.statuses or any(s not in self.statuses for s in answer.statuses):
            return f"got {got} ({message}), expected {self.describe()}"
        if any(s >= 400 for s in answer.statuses):
            missing = [n for n in self.needles if n not in answer.message]
            if missing:
                return f"the {got} does not name {', '.join(missing)}: {message}"
        if answer.stream_error:
            return f"error event in the stream: {answer.stream_error[:160]}"
        if answer.violation:
            return answer.violation
        return self.check(answer) if self.check is not None else ""


def refused(status: int, *needles: str) -> Expect:
    return Expect(frozenset({status}), needles)


def served() -> Expect:
    return Expect(frozenset({200}))


def served_or_refused(status: int, *needles: str,
                      check: Callable[[Answer], str] | None = None) -> Expect:
    return Expect(frozenset({200, status}), needles, check)


def _never_stop(answer: Answer) -> str:
    """A grammar no text of max_tokens can complete: "stop" would hide its failure."""
    if "stop" in answer.finish_reasons:
        return 'finish_reason "stop" on a grammar that cannot finish'
    return ""


# ------------------------------------------------------------------ attacks


@dataclass(frozen=True)
class RunConfig:
    """timeout_s: how long the attacker waits for an answer (its bound); stream_s: how
    long a streaming attack reads; min_window_s: the victim streams at least this long
    after an attack began."""

    timeout_s: float = 60.0
    stream_s: float = 10.0
    min_window_s: float = 1.0
    baseline_s: float = 3.0


@dataclass
class Context:
    """What an attack's function may use: a client per tenant (base URL set)."""

    url: str
    clients: dict[str, httpx.AsyncClient]
    config: RunConfig


Body = dict[str, Any] | bytes


@dataclass(frozen=True)
class Attack:
    """One hostile request: POST `body` (or `body()`) to `route` as the attacker (read
    as a stream when the body asks for one); or `send(context)` for what is not one
    POST."""

    name: str
    expect: Expect
    route: str = COMPLETIONS
    body: Body | Callable[[], Body] | None = None
    send: Callable[[Context], Awaitable[Answer]] | None = None

    async def run(self, context: Context) -> Answer:
        if self.send is not None:
            return await self.send(context)
        body = self.body() if callable(self.body) else self.body
        assert body is not None, self.name
        return await post(context, self.route, body)


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


async def post(context: Context, route: str, body: Body) -> Answer:
    """`body` to `route` as the attacker; a stream is read until its end or stream_s."""
    client = context.clients["attacker"]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    try:
        if not (isinstance(body, dict) and body.get("stream")):
            response = await client.post(route, content=content, headers=headers)
            if response.status_code != 200:
                return Answer((response.status_code,), _error_message(response))
            choices = response.json()["choices"]
            return Answer((200,), finish_reasons=tuple(c["finish_reason"] for c in choices))
        return await _read_stream(client, route, content, headers, context.config.stream_s)
    except httpx.TimeoutException:
        return Answer((0,), f"no answer within {context.config.timeout_s:g} s")


async def _read_stream(client: httpx.AsyncClient, route: str, content: bytes,
                       headers: dict[str, str], stream_s: float) -> Answer:
    finish_reasons: list[str] = []
    async with client.stream("POST", route, content=content, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return Answer((response.status_code,), _error_message(response))
        # NOTE: by time, not by events: an open tool call may send nothing for long.
        with contextlib.suppress(TimeoutError):  # long enough: the client goes away
            async with asyncio.timeout(stream_s):
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        return Answer((200,), stream_error=str(event["error"].get("message")))
                    finish_reasons += [c["finish_reason"] for c in event.get("choices", ())
                                       if c.get("finish_reason")]
    return Answer((200,), finish_reasons=tuple(finish_reasons))


async def _cross_tenant_cache(context: Context) -> Answer:
    """The victim sends a prompt twice (its repeat must hit its own cache, or the probe
    proves nothing), then the attacker sends it: it must see no cached token."""
    prompt = f"{uuid.uuid4()} " + "a ledger of ships, cargo and tides " * 12

    async def cached(tenant: str) -> int:
        response = await context.clients[tenant].post(
            COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
        response.raise_for_status()
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    await cached("victim")
    if await cached("victim") == 0:
        return Answer((200,), violation="the victim's own repeat was not cached: no probe")
    seen = await cached("attacker")
    violation = f"the attacker saw {seen} cached tokens of the victim's prompt" if seen else ""
    return Answer((200,), violation=violation)


async def _slowloris(context: Context) -> Answer:
    """A body trickled a byte at a time (10 per second): 408 at --body-timeout-s."""
    host, port = context.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Hi " * 40, "max_tokens": 1}).encode()
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {KEYS['attacker']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        answer = asyncio.ensure_future(reader.read())
        for byte in body:
            if answer.done():
                break
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.1)
        raw = await asyncio.wait_for(answer, context.config.timeout_s)
    except (TimeoutError, ConnectionError) as exc:
        return Answer((0,), f"no answer: {exc!r}")
    finally:
        writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    status = int(status_line.split()[1]) if status_line else 0
    return Answer((status,), rest.partition(b"\r\n\r\n")[2].decode(errors="replace")[:300])


async def _slow_reader(context: Context) -> Answer:
    """A stream whose client reads nothing for stream_s, then reads it to the end."""
    body = {"prompt": "Tell a long story.", "max_tokens": 32, "ignore_eos": True,
            "stream": True}
    client = context.clients["attacker"]
    async with client.stream("POST", COMPLETIONS, json=body) as response:
        await asyncio.sleep(context.config.stream_s)
        text = (await response.aread()).decode()
    if response.status_code != 200:
        return Answer((response.status_code,), text[:300])
    complete = text.rstrip().endswith("data: [DONE]")
    return Answer((200,), violation="" if complete else "the stream did not end with [DONE]")


async def _in_flight_flood(context: Context) -> Answer:
    """Twice the attacker's seats at once: the ones beyond are 429s, the others served."""
    body = {"prompt": "Count to ten:", "max_tokens": 8, "ignore_eos": True}
    responses = await asyncio.gather(*(
        context.clients["attacker"].post(COMPLETIONS, json=body)
        for _ in range(2 * ATTACKER_MAX_IN_FLIGHT)))
    statuses = tuple(sorted({r.status_code for r in responses}))
    messages = {_error_message(r) for r in responses if r.status_code != 200}
    violation = "" if 429 in statuses else "no request beyond the tenant's seats was a 429"
    return Answer(statuses, " | ".join(messages), violation=violation)


async def _unattacked(context: Context) -> Answer:
    await asyncio.sleep(context.config.baseline_s)
    return Answer((200,))


def _ids(num: int, offset: int = 0) -> list[int]:
    return [100 + (7 * i + offset) % 10_000 for i in range(num)]


def _nested_schema_text(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


_HI = [{"role": "user", "content": "Hi"}]
_ECHO_TOOL = {"type": "function", "function": {
    "name": "echo", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}
# the model writes one endless tool-call argument: every delta is inside the open call
_ENDLESS_CALL = r'<tool_call>\n\{"name": "echo", "arguments": \{"text": "[a-z ]*'
_NESTED_LOOPS = "{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}"

ATTACKS: tuple[Attack, ...] = (
    # the findings
    Attack("request_chat_template", refused(400, "--trust-request-chat-template"), CHAT,
           {"messages": _HI, "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": _NESTED_LOOPS}}),
    Attack("prompt_logprobs_amplification", refused(400, "--max-prompt-logprobs-entries"),
           body=lambda: {"prompt": [_ids(1500), _ids(1500, 1)], "n": 16, "prompt_logprobs": 20,
                         "max_tokens": 1}),
    Attack("regex_blowup", served_or_refused(400, check=_never_stop),
           body={"prompt": "a", "max_tokens": 8,
                 "structured_outputs": {"regex": "(a{1000}){1000}"}}),
    Attack("allowed_token_ids_flood", served_or_refused(400),
           body=lambda: {"prompt": "Hi", "max_tokens": 4,
                         "allowed_token_ids": [i % VOCAB_SIZE for i in range(2**17)]}),
    Attack("hermes_tool_stream", served(), CHAT,
           {"messages": [{"role": "user", "content": "Echo a long text."}],
            "tools": [_ECHO_TOOL], "tool_choice": "auto", "max_tokens": 4000,
            "ignore_eos": True, "stream": True, "structured_outputs": {"regex": _ENDLESS_CALL}}),
    Attack("cross_tenant_cache_probe", served(), send=_cross_tenant_cache),
    Attack("logit_bias_superscript_key", refused(400),
           body={"prompt": "Hi", "max_tokens": 2, "logit_bias": {"²": 1}}),
    Attack("schema_nested_50k", refused(400),
           body=lambda: {"prompt": "Hi", "max_tokens": 2,
                         "structured_outputs": {"json": _nested_schema_text(50_000)}}),
    Attack("lark_token_id_out_of_vocab", refused(400),
           body={"prompt": "Hi", "max_tokens": 2,
                 "structured_outputs": {"grammar": "start: <[999999]>"}}),
    Attack("lark_unknown_special_token", refused(400),
           body={"prompt": "Hi", "max_tokens": 2,
                 "structured_outputs": {"grammar": "start: <|no_such_special_token|>"}}),
    # more of our own
    Attack("slow_reader", served(), send=_slow_reader),
    Attack("slowloris_body", refused(408), send=_slowloris),
    Attack("tenant_in_flight_flood", served_or_refused(429), send=_in_flight_flood),
    Attack("huge_n", refused(400, "--max-n"), body={"prompt": "Hi", "max_tokens": 1, "n": 100_000}),
    Attack("long_stop_string", refused(400, "--max-stop-string-chars"),
           body={"prompt": "Hi", "max_tokens": 2, "stop": ["x" * 100_000]}),
    Attack("many_stop_strings", refused(400, "--max-stop-strings"),
           body={"prompt": "Hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(1000)]}),
    Attack("nested_json_body", refused(400),
           body=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    Attack("many_tools", refused(400, "--max-tools"), CHAT,
           {"messages": _HI, "max_tokens": 2, "tools": [_ECHO_TOOL] * 10_000}),
    Attack("huge_tool_schema", refused(400, "--max-tools-bytes"), CHAT,
           lambda: {"messages": _HI, "max_tokens": 2, "tools": [{"type": "function", "function": {
               "name": "big", "description": "d" * 1_000_000}}]}),
    Attack("huge_logprobs", refused(400, "--max-logprobs"),
           body={"prompt": "Hi", "max_tokens": 2, "logprobs": 100_000}),
    Attack("logit_bias_flood", refused(400, "--max-logit-bias"),
           body={"prompt": "Hi", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(5000)}}),
    Attack("huge_regex", refused(400, "--max-grammar-bytes"),
           body={"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"regex": "ab" * 50_000}}),
    Attack("deep_lark_grammar", refused(400, "--max-grammar-depth"),
           body={"prompt": "Hi", "max_tokens": 2, "structured_outputs": {
               "grammar": "start: " + "(" * 5000 + '"a"' + ")" * 5000}}),
    Attack("oversize_body", refused(413, "--max-body-bytes"),
           body=lambda: {"prompt": "x" * (9 * 1024**2), "max_tokens": 1}),
)
UNATTACKED = Attack("unattacked", served(), send=_unattacked)


# ------------------------------------------------------------------ measuring


@dataclass
class Measure:
    """One attack's run: the attacker's answer, whether it is a success, and what the
    victim, /health and the server's processes showed meanwhile."""

    name: str
    expected: str
    answer: Answer
    problem: str
    itl_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    rss_growth_mb: dict[str, float] = field(default_factory=dict)  # process -> peak growth
    api_cpu_s: float = 0.0
    duration_s: float = 0.0
    victim_error: str = ""
    idle_error: str = ""

    def summary(self) -> dict[str, Any]:
        itl = self.itl_s
        return {
            "attack": self.name, "expected": self.expected, "problem": self.problem,
            "answer": asdict(self.answer),
            "itl_ms": {"p50": _ms(statistics.median(itl) if itl else None),
                       "p99": _ms(_p99(itl)), "max": _ms(max(itl, default=None)),
                       "count": len(itl)},
            "ttft_ms": {"p50": _ms(statistics.median(self.ttft_s) if self.ttft_s else None),
                        "max": _ms(max(self.ttft_s, default=None))},
            "health_max_ms": _ms(max(self.health_s, default=None)),
            "rss_growth_mb": self.rss_growth_mb, "api_cpu_s": round(self.api_cpu_s, 2),
            "duration_s": round(self.duration_s, 2), "victim_error": self.victim_error,
            "idle_error": self.idle_error,
        }

    def violations(self, unattacked_itl_median_s: float) -> list[str]:
        """The isolation bounds this run broke (the victim's largest gap against the
        unattacked median, /health, RSS growth, the pool idle afterwards)."""
        found = []
        itl_bound = max(MAX_ITL_S, ITL_FACTOR * unattacked_itl_median_s)
        if self.victim_error:
            found.append(f"victim: {self.victim_error}")
        if not self.itl_s:
            found.append("the victim got no token during the attack")
        elif max(self.itl_s) > itl_bound:
            found.append(f"victim gap {max(self.itl_s):.2f} s > {itl_bound:.2f} s")
        if max(self.health_s, default=0.0) > MAX_HEALTH_S:
            found.append(f"/health took {max(self.health_s):.2f} s")
        for process, growth in self.rss_growth_mb.items():
            if growth > MAX_RSS_GROWTH_MB:
                found.append(f"{process} grew {growth:.0f} MB")
        if self.idle_error:
            found.append(f"not idle afterwards: {self.idle_error[:200]}")
        return found


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def _p99(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return max(values, default=None)
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def _victim(client: httpx.AsyncClient, running: asyncio.Event, attacked: asyncio.Event,
                  measure: Measure) -> None:
    """Streams VICTIM_BODY back to back until cancelled: the gaps and TTFTs seen after the
    attack began (a gap or a first token still awaited when cancelled counts too: a stalled
    stream shows)."""
    sent, last = time.perf_counter(), None

    def record(now: float) -> None:
        if attacked.is_set():
            (measure.ttft_s if last is None else measure.itl_s).append(
                now - (sent if last is None else last))

    try:
        while True:
            sent, last = time.perf_counter(), None
            async with client.stream("POST", COMPLETIONS, json=VICTIM_BODY) as response:
                if response.status_code != 200:
                    measure.victim_error = f"{response.status_code}: {await response.aread()!r}"
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        record(now := time.perf_counter())
                        last = now
                        running.set()
    except asyncio.CancelledError:
        record(time.perf_counter())
        raise
    except httpx.HTTPError as exc:
        measure.victim_error = repr(exc)


async def _probe_health(client: httpx.AsyncClient, measure: Measure) -> None:
    while True:
        sent = time.perf_counter()
        try:
            await client.get("/health")
        except asyncio.CancelledError:
            measure.health_s.append(time.perf_counter() - sent)
            raise
        measure.health_s.append(time.perf_counter() - sent)
        await asyncio.sleep(0.05)


async def _sample_rss(pids: dict[str, int], peaks: dict[str, int]) -> None:
    while True:
        for process, pid in pids.items():
            peaks[process] = max(peaks[process], read_rss_kib(pid) or 0)
        await asyncio.sleep(0.1)


def server_pids(server: ServerProcess) -> dict[str, int]:
    """The API process and its engine core(s), by name."""
    children = server.child_pids()
    cores = {"core" if len(children) == 1 else f"core{k}": pid for k, pid in enumerate(children)}
    return {"api": server.pid, **cores}


async def run_attack(url: str, pids: dict[str, int], attack: Attack,
                     config: RunConfig) -> Measure:
    """`attack` while the victim streams; the measure of its answer and of the bounds."""
    before = {process: read_rss_kib(pid) or 0 for process, pid in pids.items()}
    peaks = dict(before)
    cpu_before = cpu_seconds(pids["api"])
    running, attacked = asyncio.Event(), asyncio.Event()
    measure = Measure(attack.name, attack.expect.describe(), Answer(()), "")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    clients = {tenant: httpx.AsyncClient(base_url=url, headers=auth(tenant), limits=limits,
                                         timeout=config.timeout_s) for tenant in KEYS}
    health = httpx.AsyncClient(base_url=url, timeout=config.timeout_s)
    try:
        tasks = [asyncio.ensure_future(_victim(clients["victim"], running, attacked, measure)),
                 asyncio.ensure_future(_probe_health(health, measure)),
                 asyncio.ensure_future(_sample_rss(pids, peaks))]
        await asyncio.wait_for(running.wait(), 60)
        attacked.set()
        started = time.perf_counter()
        try:
            answer = await asyncio.wait_for(attack.run(Context(url, clients, config)),
                                            config.timeout_s + 5)
        except TimeoutError:
            answer = Answer((0,), f"no answer within {config.timeout_s + 5:g} s")
        except httpx.HTTPError as exc:  # the connection broke, or a probe's status
            answer = Answer((0,), f"{type(exc).__name__}: {exc}")
        measure.duration_s = time.perf_counter() - started
        await asyncio.sleep(max(0.0, config.min_window_s - measure.duration_s))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for client in (*clients.values(), health):
            await client.aclose()
    measure.answer, measure.problem = answer, attack.expect.problem(answer)
    measure.api_cpu_s = cpu_seconds(pids["api"]) - cpu_before
    measure.rss_growth_mb = {p: round((peaks[p] - before[p]) / 1024, 1) for p in pids}
    try:
        await asyncio.to_thread(wait_idle, url, auth("operator"), 30.0)
    except (AssertionError, httpx.HTTPError) as exc:  # still busy, or no answer at all
        measure.idle_error = f"{type(exc).__name__}: {exc}"
    return measure


# ------------------------------------------------------------------ the bench


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per attack: outcome, the victim's ITL and TTFT (ms), /health max (ms), the
    largest RSS growth (MB), the API process's CPU seconds and the attack's duration."""
    head = (f"{'attack':30} {'outcome':44} {'ITL p50/p99/max':>17} {'TTFT p50/max':>13} "
            f"{'health':>7} {'RSS+MB':>7} {'APIcpu':>6} {'secs':>5}")
    lines = [head, "-" * len(head)]
    for row in rows:
        itl, ttft = row["itl_ms"], row["ttft_ms"]
        outcome = row["outcome"]
        lines.append(
            f"{row['attack']:30} {outcome[:44]:44} "
            f"{_fmt(itl['p50']) + '/' + _fmt(itl['p99']) + '/' + _fmt(itl['max']):>17} "
            f"{_fmt(ttft['p50']) + '/' + _fmt(ttft['max']):>13} {_fmt(row['health_max_ms']):>7} "
            f"{max(row['rss_growth_mb'].values(), default=0):>7.0f} {row['api_cpu_s']:>6.1f} "
            f"{row['duration_s']:>5.1f}")
    return "\n".join(lines)


def outcome(measure: Measure, unattacked_itl_median_s: float) -> str:
    """"ok: <statuses>", or what failed: the expectation first, then the bounds."""
    failures = [measure.problem] if measure.problem else []
    failures += measure.violations(unattacked_itl_median_s)
    statuses = "/".join(str(s) for s in measure.answer.statuses)
    return f"ok: {statuses}" if not failures else "FAIL: " + "; ".join(failures)


async def run_all(url: str, pids: dict[str, int], attacks: Sequence[Attack],
                  config: RunConfig, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The unattacked run, then each attack: their summaries with an outcome each."""
    baseline = await run_attack(url, pids, UNATTACKED, config)
    median = statistics.median(baseline.itl_s)
    rows = []
    for attack in (UNATTACKED, *attacks):
        measure = baseline if attack is UNATTACKED else await run_attack(url, pids, attack,
                                                                          config)
        row = {**measure.summary(), "outcome": outcome(measure, median)}
        log(f"{attack.name}: {row['outcome']} ({measure.duration_s:.1f} s)")
        rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.isolation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", help="comma-separated attack names (default: all)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="how long the attacker waits for an answer")
    parser.add_argument("--stream-s", type=float, default=10.0,
                        help="how long a streaming attack reads (the tool-call stream's "
                        "length)")
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for attack in ATTACKS:
            print(f"{attack.name:32} {attack.expect.describe()}")
        return 0
    by_name = {a.name: a for a in ATTACKS}
    names = args.attacks.split(",") if args.attacks else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"unknown attacks: {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    config = RunConfig(timeout_s=args.timeout_s, stream_s=args.stream_s)
    with tempfile.TemporaryDirectory() as folder:
        tenants = Path(folder) / "tenants.yaml"
        tenants.write_text(tenants_yaml())
        server = ServerProcess([*SERVER_FLAGS, "--tenants", str(tenants)],
                               log_prefix="pagedserve-isolation-")
        try:
            server.wait_healthy()
            rows = asyncio.run(run_all(server.url, server_pids(server),
                                       [by_name[n] for n in names], config,
                                       lambda line: print(line, file=sys.stderr)))
        finally:
            server.terminate()
            print(f"server log: {server.log.name}", file=sys.stderr)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(row["outcome"].startswith("ok") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
