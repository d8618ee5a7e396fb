"""The hostile-client suite's attacks as data: the tenants, the server flags they need,
and each attack (one line of ATTACKS: a route and a body, or a small async function for
the protocol-level ones) with what counts as success (`refused(status, *needles)`,
`served()`, `served_or_refused(...)`).

Run by tests/e2e/test_isolation.py and measured by bench/isolation.py, both through
tests/support/isolation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
KEYS = {"victim": "isolation-victim-key", "attacker": "isolation-attacker-key",
        "operator": "isolation-operator-key"}
ATTACKER_MAX_IN_FLIGHT = 4
BODY_TIMEOUT_S = 1.0
VOCAB_SIZE = 49152  # the default model's (SmolLM2)

SERVER_FLAGS = (
    "--scheduling-policy", "priority", "--tool-call-parser", "hermes",
    "--body-timeout-s", str(BODY_TIMEOUT_S), "--num-kv-blocks", "512", "--max-num-seqs", "32",
    "--log-level", "warning",
)


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
    POST. `max_rss_growth_mb`: a bound tighter than the suite's on every server process."""

    name: str
    expect: Expect
    route: str = COMPLETIONS
    body: Body | Callable[[], Body] | None = None
    send: Callable[[Context], Awaitable[Answer]] | None = None
    max_rss_growth_mb: float | None = None

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


async def _tokenize_flood(context: Context) -> Answer:
    """Twice the attacker's seats of /tokenize at once, each 66,000 CJK characters (~0.2 s
    of the tokenizer thread): the ones beyond its seats are 429s. NOTE: a tenth of the
    issue's 660,000 (just within the context's characters), one tokenizing of which peaks
    at ~300 MB in the API process and takes a core for ~1.9 s whatever the seats (four in
    a row starved the engine core of a loaded 2-core machine)."""
    body = {"prompt": "漢字" * 33_000}
    responses = await asyncio.gather(*(
        context.clients["attacker"].post("/tokenize", json=body)
        for _ in range(2 * ATTACKER_MAX_IN_FLIGHT)))
    statuses = tuple(sorted({r.status_code for r in responses}))
    messages = {_error_message(r) for r in responses if r.status_code != 200}
    violation = "" if 429 in statuses else "no /tokenize beyond the tenant's seats was a 429"
    return Answer(statuses, " | ".join(messages), violation=violation)


async def _echo_never_run(context: Context) -> Answer:
    """A streamed echo with logprobs of 12 prompts of 8,000 ids whose deadline passes
    before they run: the echo comes back with no logprob entry per prompt token."""
    body = {"prompt": [_ids(8000, k) for k in range(12)], "echo": True, "logprobs": 0,
            "max_tokens": 1, "stream": True, "deadline_ms": 1}
    async with context.clients["attacker"].stream("POST", COMPLETIONS, json=body) as response:
        text = (await response.aread()).decode()
    if response.status_code != 200:
        return Answer((response.status_code,), text[:300])
    choices = [c for line in text.splitlines() if line.startswith("data: {")
               for c in json.loads(line[len("data: "):]).get("choices", ())]
    scored = sum(len((c.get("logprobs") or {}).get("tokens", ())) for c in choices)
    return Answer((200,), finish_reasons=tuple(c["finish_reason"] for c in choices
                                               if c.get("finish_reason")),
                  violation=f"{scored} logprob entries of prompts never run" if scored else "")


async def _two_authorization_headers(context: Context) -> Answer:
    """The attacker's key and the victim's, as two Authorization headers (a proxy in front
    that checks one must not see the server act on the other)."""
    headers = [("Authorization", f"Bearer {KEYS[tenant]}") for tenant in ("attacker", "victim")]
    response = await context.clients["attacker"].post(  # NOTE: these replace the client's
        COMPLETIONS, headers=headers, json={"prompt": "Hi", "max_tokens": 1})
    if len(response.request.headers.get_list("Authorization")) != 2:
        return Answer((0,), violation="the client did not send two Authorization headers")
    return Answer((response.status_code,), _error_message(response))


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
_DEEP_ARGUMENTS = "[" * 5000 + "]" * 5000
_DEEP_CALL = [*_HI, {"role": "assistant", "content": "", "tool_calls": [{
    "id": "c1", "type": "function", "function": {"name": "echo", "arguments": _DEEP_ARGUMENTS}}]}]
_DEEP_ITEMS = [{"role": "user", "content": "Hi"}, {
    "type": "function_call", "call_id": "c1", "name": "echo", "arguments": _DEEP_ARGUMENTS}]

ATTACKS: tuple[Attack, ...] = (
    # the findings
    Attack("request_chat_template", refused(400, "--trust-request-chat-template"), CHAT,
           {"messages": _HI, "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": _NESTED_LOOPS}}),
    Attack("prompt_logprobs_amplification", refused(400, "--max-prompt-logprobs-entries"),
           body=lambda: {"prompt": [_ids(1500), _ids(1500, 1)], "n": 16, "prompt_logprobs": 20,
                         "max_tokens": 1}),
    Attack("regex_blowup", refused(400), max_rss_growth_mb=100,  # it forces 97,908 bytes
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
    # issue 44's: work before the seat, unbounded nesting, uncharged work
    Attack("responses_consecutive_answers", refused(400, "context length"), "/v1/responses",
           lambda: {"input": [{"role": "assistant", "content": "a" * 4000}] * 2048}),
    Attack("tool_arguments_nested_chat", refused(400, "--max-tool-arguments-depth"), CHAT,
           {"messages": _DEEP_CALL, "max_tokens": 2}),
    Attack("tool_arguments_nested_responses", refused(400, "--max-tool-arguments-depth"),
           "/v1/responses", {"input": _DEEP_ITEMS, "max_output_tokens": 2}),
    Attack("tool_arguments_nested_tokenize", refused(400, "--max-tool-arguments-depth"),
           "/tokenize", {"messages": _DEEP_CALL}),
    Attack("tokenize_flood", served_or_refused(429), send=_tokenize_flood),
    Attack("echo_of_prompts_never_run", served(), send=_echo_never_run),
    Attack("allowed_token_ids_2m_strings", Expect(  # 8 MB: counted on its bytes, one short 400
        frozenset({400}), ("--max-json-values", "allowed_token_ids"),
        lambda a: "" if len(a.message) <= 1024 else f"a message of {len(a.message)} chars"),
        body=lambda: b'{"prompt": "Hi", "max_tokens": 4, "allowed_token_ids": ['
        + b'"1",' * 1_999_999 + b'"1"]}'),
    Attack("two_authorization_headers", refused(400, "more than one Authorization header"),
           send=_two_authorization_headers),
    Attack("unknown_field_2_6m_empty_lists", served(),  # 7.8 MB never decoded
           body=lambda: b'{"prompt": "Hi", "max_tokens": 4, "x": [' + b"[]," * 2_599_999 + b"[]]}"),
)
UNATTACKED = Attack("unattacked", served(), send=_unattacked)

# A server started with these flags too (the suite's refuses a request's own template).
TRUSTED_TEMPLATE_FLAGS = ("--trust-request-chat-template",)
TRUSTED_TEMPLATE_ATTACKS: tuple[Attack, ...] = (
    # ~6.5 s in one C call holding the GIL: its worker is killed at the deadline
    Attack("trusted_template_in_c", refused(400, "--chat-template-timeout-s"), CHAT,
           {"messages": _HI, "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": "{{ (9 ** 10000000) > 1 }}"}}),
)
