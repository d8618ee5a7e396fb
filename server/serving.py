"""What the two generation routes share: parsing and checking a request, tokenizing off
the event loop, submitting to the engine, gathering a non-streamed result, usage, and
writing a response with logprobs off the event loop (prompt logprobs as JSON once per
prompt, shared by its choices).

Bodies are parsed here rather than by FastAPI, so that a missing or wrong Content-Type is
no error and the checks run in a fixed order: key (middleware), body size (middleware),
JSON, schema, model, priority, budgets, load, the tenant's seat and rate, then (with the
work) context length, prompt_logprobs entries and the tenant's exact token charge.

Limits that keep one request from taking the server down: the JSON nesting depth and
integer size, the protocol's bounds, the request budgets (server/limits.py), the
prompt's characters (checked before tokenizing, so that a huge prompt costs no tokenizer
time) and tokens against the context, prompt plus max_tokens against the context, and
the chat template's time: each is a 400 naming the limit. The tenant's seat is taken
before any work and released on every path (`handle`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import math
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import pydantic
from fastapi import Request
from fastapi.responses import Response

from engine.client import Engine
from engine.data_parallel import DataParallelEngine
from engine.outputs import EngineDeadError, EngineStepError, RequestOutput, RequestStream
from engine.request import EngineRequest
from scheduler.output import PromptLogprobs, SampleLogprobs
from scheduler.sampling_params import SamplingParams
from server.config import ServerConfig
from server.errors import APIError, server_error, validation_error
from server.limits import check_budgets, check_prompt_logprobs, flag_of, over_limit
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
)
from server.structured_output import Constraint, GrammarError, request_grammar
from server.tenants import Seat, Tenant, TenantRefused
from structured.compiler import GrammarCompiler

# A JSON escape of a UTF-16 surrogate: the parsed strings may hold an unpaired one.
_SURROGATE_ESCAPE_RE = re.compile(rb"\\u[dD][89a-fA-F]")

_RequestT = TypeVar("_RequestT", bound=SamplingRequest)
_ModelT = TypeVar("_ModelT", bound=pydantic.BaseModel)
_T = TypeVar("_T")

_RENDER_THREADS = 2  # responses with logprobs written at once, off the event loop


@dataclass
class Placement:
    """What a request's tenant made of it: its priority, deadline, cache salt and seat
    (`submitted` once the engine holds the request, and with it the seat)."""

    tenant: Tenant
    priority: int
    deadline: float | None
    cache_salt: str | None
    seat: Seat
    submitted: bool = False


@dataclass
class Choice:
    """A choice's text, tokens and logprobs gathered from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.text += output.text
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs or [])
        self.num_output_tokens = output.num_output_tokens
        self.num_preemptions = output.num_preemptions
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason


class Serving:
    """Checks, tokenization and engine access of the generation routes (one per app)."""

    def __init__(self, engine: Engine | DataParallelEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.info.tokenizer  # the event loop's (logprob tokens)
        self.max_prompt_chars = _max_prompt_chars(self.tokenizer, engine.info.max_model_len)
        # NOTE: tokenizing and chat templates run off the event loop, so that a huge prompt
        # stalls no other stream nor /health; one thread with its own copy of the
        # tokenizer, as a fast tokenizer is not thread-safe.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.pool_tokenizer = copy.deepcopy(self.tokenizer)
        # NOTE: the JSON of a response with logprobs is written off the event loop too
        # (`render`): prompt logprobs of n choices can be tens of megabytes.
        self._render_pool = concurrent.futures.ThreadPoolExecutor(
            _RENDER_THREADS, thread_name_prefix="render"
        )
        # NOTE: grammars compile (and compute their first mask) on threads of their own, not
        # the tokenizer's: a slow grammar delays no prompt.
        grammar_tokenizer = engine.info.grammar_tokenizer
        self.grammars = (None if grammar_tokenizer is None
                         else GrammarCompiler(grammar_tokenizer, num_threads=2))
        self.model_names = (engine.info.model_name, *config.model_aliases)

    @property
    def model_name(self) -> str:
        return self.engine.info.model_name

    async def in_pool(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the tokenizer thread (which owns `pool_tokenizer`)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------ validation

    async def parse_json(self, raw: Request, model: type[_ModelT]) -> _ModelT:
        """The body as `model` (any pydantic model): a 400 for bad JSON or fields."""
        body = await raw.body()
        try:
            data = json.loads(body)
        except RecursionError as exc:
            raise APIError(400, "Request body is not valid JSON: nested too deeply.") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"Request body is not valid JSON: {exc}") from exc
        except ValueError as exc:  # an integer of more than 4300 digits
            raise APIError(400, "Request body is not valid JSON: a number is too long.") from exc
        if not isinstance(data, dict):
            raise APIError(400, "Request body must be a JSON object.")
        if _SURROGATE_ESCAPE_RE.search(body) and _has_lone_surrogate(data):
            raise APIError(
                400, "Request body is not valid JSON: a string holds an unpaired UTF-16 "
                "surrogate (\\ud800-\\udfff), which is no Unicode character."
            )
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as exc:
            raise validation_error(exc.errors(include_url=False)) from exc

    async def handle(self, raw: Request, route: Callable[[Request], Awaitable[Response]]
                     ) -> Response:
        """`route(raw)`, a generation route; the tenant's seat its `parse` took is released
        here unless the engine took the request (whose end releases it)."""
        try:
            return await route(raw)
        finally:
            placement: Placement | None = getattr(raw.state, "placement", None)
            if placement is not None and not placement.submitted:
                placement.seat.release()

    async def parse(
        self, raw: Request, model: type[_RequestT], arrival: float
    ) -> tuple[_RequestT, Placement]:
        """A generation request's body as `model` and its placement under the request's
        tenant (403 for a priority beyond the tenant's bound, 429 without a seat or room
        in its token rate), after the checks that need no tokens: before any work."""
        request = await self.parse_json(raw, model)
        self._check_admission(request)
        placement = self._place(raw.state.tenant, request, arrival)
        raw.state.placement = placement  # for `handle`, which releases its seat
        return request, placement

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is None or a name this server serves."""
        if model is not None and model not in self.model_names:
            raise APIError(
                404, f"The model `{model}` does not exist; this server serves "
                f"`{self.model_name}`.", param="model", code="model_not_found",
            )

    def _place(self, tenant: Tenant, body: SamplingRequest, arrival: float) -> Placement:
        requested = body.priority if "priority" in body.model_fields_set else None
        try:
            priority = tenant.priority(requested)
        except TenantRefused as exc:
            raise self._refused(tenant, exc) from exc
        if self.engine.info.policy != "priority":
            priority = 0  # FCFS orders by arrival alone
        salt = None
        if tenant.cache_salt is not None or body.cache_salt is not None:
            # NOTE: the tenant's part first: no request's own salt can reproduce it.
            salt = f"{tenant.cache_salt or ''}\x00{body.cache_salt or ''}"
        try:
            seat = tenant.admit(_tokens_at_least(body))
        except TenantRefused as exc:
            raise self._refused(tenant, exc) from exc
        return Placement(tenant, priority, tenant.deadline(arrival, body.deadline_ms), salt,
                         seat)

    def _refused(self, tenant: Tenant, refusal: TenantRefused) -> APIError:
        self.engine.metrics.inc_tenant_rejection(tenant.name, refusal.reason)
        headers = None
        if refusal.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))}
        code = {"priority": "priority_not_allowed", "in_flight": "too_many_requests_in_flight",
                "rate": "rate_limit_exceeded"}[refusal.reason]
        param = "priority" if refusal.reason == "priority" else None
        return APIError(refusal.status_code, str(refusal), param=param, code=code,
                        headers=headers)

    def _check_admission(self, body: SamplingRequest) -> None:
        info = self.engine.info
        self.check_model(body.model)
        if body.priority != 0 and info.policy != "priority":
            raise APIError(
                400, f"priority is not supported under the {info.policy} scheduling policy: "
                "start the server with `--scheduling-policy priority`.", param="priority",
            )
        check_budgets(body, self.config.limits)
        if not self.engine.is_alive:
            raise server_error(
                503, f"The engine is not serving: {self.engine.unavailable_reason()}."
            )
        vocab_size = info.vocab_size
        bad_ids = [t for t in body.token_ids_to_check if t >= vocab_size]
        if bad_ids:
            raise APIError(
                400, f"token id {bad_ids[0]} (in stop_token_ids, logit_bias or "
                f"allowed_token_ids) is out of range: the vocabulary has {vocab_size} tokens.",
                param="stop_token_ids" if bad_ids[0] in (body.stop_token_ids or ()) else None,
            )
        limit = self.config.max_waiting
        if limit is not None and self.engine.num_waiting >= limit:
            raise server_error(
                503, f"The server is overloaded: {limit} requests are waiting. Retry later.",
                code="server_overloaded", headers={"Retry-After": str(self.config.retry_after_s)},
            )

    def check_prompt_chars(self, text: str, what: str, param: str) -> None:
        """400 for a text that surely has more tokens than the context, before tokenizing
        it (which takes seconds for megabytes)."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(
                400, f"This model's maximum context length is {self.engine.info.max_model_len} "
                f"tokens, at most {limit} characters of text. However, your {what} is "
                f"{len(text)} characters long. Please reduce the length of the {param}.",
                param=param,
            )

    def check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        info = self.engine.info
        if not prompt:
            raise APIError(400, "The prompt is empty.", param="prompt")
        bad = [t for t in prompt if t >= info.vocab_size]
        if bad:
            raise APIError(
                400, f"Token id {bad[0]} is out of range: the vocabulary has "
                f"{info.vocab_size} tokens.", param="prompt",
            )
        limit = info.max_model_len
        if len(prompt) >= limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {len(prompt)} input tokens, which leaves no room for output. "
                "Please reduce the length of the input.", param="prompt",
            )
        if len(prompt) + max_tokens > limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt "
                "or of max_tokens.", param="max_tokens",
            )

    @staticmethod
    def sampling_params(
        body: SamplingRequest, max_tokens: int, logprobs: int | None, grammar: str | None
    ) -> SamplingParams:
        try:
            return body.to_sampling_params(max_tokens, logprobs, grammar)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def grammar(
        self, body: SamplingRequest, forced_tool: Callable[[], str | None] | None = None
    ) -> str | None:
        """The request's output grammar (server/structured_output.py; `forced_tool` builds
        a forced tool call's), within the grammar budgets and checked on the tokenizer
        thread, then compiled for the model's tokenizer with its first mask; a 400 naming
        why it cannot be."""
        try:
            constraint = await self.in_pool(request_grammar, body, self.config.limits,
                                            forced_tool)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        if constraint is None:
            return None
        if self.grammars is None:
            raise APIError(400, "Structured outputs and forced tool calls are not available "
                           "on this server (its tokenizer is not one llguidance reads).")
        await self._compile(self.grammars, constraint)
        return constraint.grammar

    async def _compile(self, grammars: GrammarCompiler, constraint: Constraint) -> None:
        """Compile the grammar and compute its first mask (cached by grammar) within
        --grammar-timeout-s; a 400 when it fails or takes longer (the compile then runs on,
        within llguidance's limits, and stays cached)."""
        limit = self.config.limits.grammar_timeout_s
        compiled = asyncio.wrap_future(grammars.compile(constraint.grammar))
        done, _ = await asyncio.wait({compiled}, timeout=limit)
        param = constraint.param
        if not done:
            compiled.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise APIError(400, f"{param}: " + over_limit(
                "the grammar took too long to compile and compute its first token mask",
                limit, "grammar_timeout_s"), param=param)
        error = compiled.exception()
        if error is not None:
            raise APIError(400, f"{param}: {error}", param=param) from error

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """On the tokenizer thread."""
        return list(self.pool_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_all(self, prompts: list[list[int]]) -> list[str]:
        """On the tokenizer thread."""
        return [str(self.pool_tokenizer.decode(p)) for p in prompts]

    def render_chat(
        self, body: ChatCompletionRequest, add_generation_prompt: bool = True
    ) -> list[int]:
        """The messages (and tools) through the chat template, as tokens; on the tokenizer
        thread. A 400 when the template rejects them, takes longer than
        --chat-template-timeout-s, or the text is surely too long; a request's own
        template (`chat_template_kwargs.chat_template`) only with
        --trust-request-chat-template."""
        limits = self.config.limits
        messages = [m.to_template_dict() for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        if "chat_template" in kwargs and not limits.trust_request_chat_template:
            raise APIError(
                400, "chat_template_kwargs.chat_template: this server does not run a "
                "request's own chat template; its operator may allow it with "
                f"{flag_of('trust_request_chat_template')}.", param="chat_template_kwargs",
            )
        if body.effective_tool_choice != "none" and body.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        if self.config.chat_template is not None:
            kwargs.setdefault("chat_template", self.config.chat_template)
        try:
            text = call_with_deadline(
                lambda: self.pool_tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                    **kwargs,
                ),
                limits.chat_template_timeout_s,
            )
        except DeadlineExceeded as exc:
            raise APIError(400, over_limit(
                "the chat template took too long to render (seconds)",
                limits.chat_template_timeout_s, "chat_template_timeout_s",
            ), param="messages") from exc
        except Exception as exc:  # jinja errors: the messages do not fit the template
            raise APIError(400, f"Cannot apply the chat template: {exc}", param="messages") from exc
        self.check_prompt_chars(text, "rendered chat", "messages")
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text (on the event loop or a render thread: decoding only reads the
        tokenizer)."""
        return str(self.tokenizer.decode([token_id]))

    def prompt_logprobs_json(self, prompts: list[list[int]], n: int) -> PromptLogprobsJSON:
        """The writer of a request's prompt logprobs (`n` choices per prompt)."""
        return PromptLogprobsJSON(self.token_text, prompts, n)

    async def render(self, params: SamplingParams, build: Callable[[], _T]) -> _T:
        """`build()` (a response's JSON): on the event loop when the request asked for no
        logprobs, else on a render thread, as its JSON can be megabytes."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return build()
        return await self.off_loop(build)

    async def off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on a render thread (NOTE: not the tokenizer's, so that a large
        response waits for no tokenizing, nor a prompt for a large response)."""
        return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn, *args)

    # ------------------------------------------------------ engine

    def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        body: SamplingRequest,
        placement: Placement,
        arrival: float,
    ) -> RequestStream:
        """Into the engine, once its prompt_logprobs entries are within their budget (400)
        and the tenant's token rate has room for its exact tokens (429); the engine holds
        the tenant's seat from then on and releases it when the request ends."""
        tenant = placement.tenant
        check_prompt_logprobs(prompts, body, self.config.limits)
        asked = sum(len(p) for p in prompts) + params.max_tokens * len(prompts) * body.n
        try:
            placement.seat.charge(asked)
        except TenantRefused as exc:
            raise self._refused(tenant, exc) from exc
        request = EngineRequest(
            request_id, prompts, params, n=body.n, stop=body.stop_strings,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            priority=placement.priority, arrival_time=arrival, tenant=tenant.name,
            weight=tenant.weight, deadline=placement.deadline, cache_salt=placement.cache_salt,
            priority_bound=tenant.spec.max_priority,
        )
        try:
            stream = self.engine.add_request(request, on_done=placement.seat.release)
        except EngineDeadError as exc:
            raise server_error(503, str(exc)) from exc
        placement.submitted = True
        return stream

    async def collect(self, stream: RequestStream, raw: Request) -> list[Choice] | None:
        """Every choice's full output; None when the client went away first (aborted)."""

        async def gather() -> list[Choice]:
            choices: dict[int, Choice] = {}
            async for output in stream:
                choices.setdefault(output.index, Choice()).add(output)
            return [choices[i] for i in sorted(choices)]

        gather_task = asyncio.ensure_future(gather())
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({gather_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
            if not gather_task.done():
                return None
            choices = gather_task.result()
        except EngineStepError as exc:
            if exc.status_code == 400:
                raise APIError(400, str(exc)) from exc
            raise server_error(500, str(exc)) from exc
        finally:
            for task in (gather_task, disconnect_task):
                task.cancel()
            if not stream.finished:
                self.engine.abort(stream.request_id)
        if all(c.finish_reason == "deadline" and not c.num_output_tokens for c in choices):
            raise APIError(504, "The request's deadline passed before it was computed.",
                           type="timeout_error", code="deadline_exceeded")
        return choices


def _tokens_at_least(body: SamplingRequest) -> int:
    """The tokens (prompt plus max_tokens) a request surely asks for before any work: its
    max_tokens (or 1) per choice, and its prompts' tokens when they are ids."""
    if isinstance(body, CompletionRequest):
        prompts = body.prompts
        prompt_ids = sum(len(p) for p in prompts if isinstance(p, list))
        return prompt_ids + (body.max_tokens or 1) * len(prompts) * body.n
    if isinstance(body, ChatCompletionRequest):
        return (body.requested_max_tokens or 1) * body.n
    return (body.max_tokens or 1) * body.n


class DeadlineExceeded(BaseException):
    """Raised inside a call that ran past its deadline (`call_with_deadline`).

    NOTE: a BaseException, so that no `except Exception` on the way (jinja has some)
    swallows it."""


def call_with_deadline(
    fn: Callable[[], _T], timeout_s: float, clock: Callable[[], float] = time.monotonic
) -> _T:
    """`fn()`, stopped with DeadlineExceeded at its first Python call past `timeout_s`.

    NOTE: a trace hook on this thread that looks only at "call" events (it returns None,
    so no line is traced): jinja templates compile to Python, whose loops call (range,
    filters, the output generator), so a template cannot run long without one. A loop of
    C code alone (a huge string's characters) is not stopped before it ends."""
    deadline = clock() + timeout_s

    def trace(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and clock() > deadline:
            raise DeadlineExceeded
        return None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def usage(prompts: list[list[int]], choices: Sequence[Choice]) -> UsageInfo:
    """Usage of a request: each prompt counted once, as are its cached tokens (those of
    its first choice, which computes the prompt for the others)."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    n = max(1, len(choices) // max(1, len(prompts)))
    cached_tokens = sum(c.num_cached_tokens for c in choices[::n])
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def json_response(content: bytes) -> Response:
    """A response's JSON (`response_json`) as the HTTP response."""
    return Response(content, media_type="application/json")


class PromptLogprobsJSON:
    """vLLM's `prompt_logprobs` of a request's choices as JSON: None for the first prompt
    token, then per token {token id: {logprob, rank, decoded_token}} of the token itself
    and its top-k. Written once per prompt: the choices of a prompt that share their
    prompt logprobs (n > 1: the very same object) share its JSON too."""

    def __init__(self, token_text: Callable[[int], str], prompts: list[list[int]], n: int):
        self._token_text = token_text
        self._prompts = prompts
        self._n = n
        self._texts: dict[int, str] = {}
        self._written: dict[int, tuple[PromptLogprobs, orjson.Fragment]] = {}  # by prompt

    def __call__(self, index: int, logprobs: PromptLogprobs | None) -> orjson.Fragment | None:
        """Choice `index`'s (None when the request asked for none)."""
        if logprobs is None:
            return None
        p = index // self._n
        written = self._written.get(p)
        if written is None or written[0] is not logprobs:
            entries = self._entries(self._prompts[p], logprobs)
            written = self._written[p] = (logprobs, orjson.Fragment(orjson.dumps(entries)))
        return written[1]

    def _entries(self, prompt: list[int], logprobs: PromptLogprobs) -> list[Any]:
        result: list[Any] = [None]
        for i, (logprob, rank, top) in enumerate(
            zip(logprobs.logprobs, logprobs.ranks, logprobs.top, strict=True)
        ):
            token_id = prompt[logprobs.start + i]
            tokens = {str(token_id): self._entry(token_id, logprob, rank)}
            for j, (top_id, top_logprob) in enumerate(top):
                tokens.setdefault(str(top_id), self._entry(top_id, top_logprob, j + 1))
            result.append(tokens)
        return result

    def _entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        """A `PromptLogprob` (server/protocol.py) as a dict."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._token_text(token_id)
        return {"logprob": logprob, "rank": rank, "decoded_token": text}


def response_json(
    model: pydantic.BaseModel, prompt_logprobs: Sequence[orjson.Fragment | None]
) -> bytes:
    """`model` (a response or a chunk) as JSON, its choice i with `prompt_logprobs[i]` (the
    JSON written once per prompt, spliced in as it is). NaN and infinities are null, as
    pydantic writes them."""
    if all(p is None for p in prompt_logprobs):
        return model.model_dump_json().encode()
    data = model.model_dump(mode="json")
    for choice, fragment in zip(data["choices"], prompt_logprobs, strict=True):
        if fragment is not None:
            choice["prompt_logprobs"] = fragment
    return orjson.dumps(data)


def _max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """Characters beyond which a text cannot fit in max_model_len tokens (None: unknown).

    No token decodes to more characters than its vocabulary entry has (byte-level BPE
    writes each byte as one character, SentencePiece a space as one), so a text longer
    than max_model_len x the longest entry has more tokens than the context holds.
    NOTE: a normalizer may shorten the text before it is split (NFC composes up to three
    characters into one), hence the slack when the tokenizer has one.
    """
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    except Exception:  # no get_vocab (or an unusual one): no limit but the tokens'
        return None
    if longest == 0:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    slack = 1 if backend is None or backend.normalizer is None else 4
    return max_model_len * longest * slack


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a string anywhere in parsed JSON holds an unpaired surrogate."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def _wait_for_disconnect(raw: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
