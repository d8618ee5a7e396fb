"""Admission of a generation request, before any work: its body parsed, checked and
placed under its tenant; and the checks of its prompt once tokenized.

Bodies are parsed here rather than by FastAPI, so that a missing or wrong Content-Type is
no error and the checks run in a fixed order: key (middleware), body size (middleware),
JSON, schema, model, priority, budgets, load, the tenant's seat and rate, then (with the
work: server/serving.py) context length, prompt_logprobs entries and the tenant's exact
token charge.

Limits that keep one request from taking the server down: the JSON nesting depth and
integer size, the request models' bounds, the request budgets (server/limits.py), the
prompt's characters (checked before tokenizing, so that a huge prompt costs no tokenizer
time) and tokens against the context, prompt plus max_tokens against the context: each
is a 400 naming the limit. The tenant's seat is taken before any work and released on
every path (`handle`); a request refused after its prompt was tokenized is charged the
tokens that cost. /tokenize and /detokenize take a seat too (`take_seat`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import Response

from engine.client import EngineClient
from engine.data_parallel import DataParallelEngine
from scheduler.placement import Placement
from server.config import ServerConfig
from server.errors import APIError, server_error, validation_error
from server.json_body import decode_fields
from server.limits import ListBudgets, check_budgets
from server.requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from server.slo import ResolvedSlo, misses_at_the_door, resolve_slo
from server.tenants import Seat, Tenant, TenantRefused

_RequestT = TypeVar("_RequestT", bound=SamplingRequest)
_ModelT = TypeVar("_ModelT", bound=pydantic.BaseModel)


@dataclass
class Admitted:
    """A request admitted under its tenant: its placement (who it is and how it wants to
    be scheduled: the record the engine carries whole), its tenant and the seat it holds
    (`submitted` once the engine holds the request, and with it the seat)."""

    placement: Placement
    tenant: Tenant
    seat: Seat
    submitted: bool = False
    num_tokenized: int = 0  # prompt tokens made so far: charged if it is refused after


class Admission:
    """The checks of a request before its work and its tenant's placement, over one
    engine (server/serving.py's `Serving` goes on from here to the work)."""

    def __init__(self, engine: EngineClient | DataParallelEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_names = (engine.info.model_name, *config.model_aliases)
        # the LoRA adapters served: name -> PEFT folder (server/lora.py)
        self.loras: dict[str, str] = dict(engine.info.loras or {})
        self.max_prompt_chars = _max_prompt_chars(engine.info.tokenizer,
                                                  engine.info.max_model_len)

    @property
    def model_name(self) -> str:
        return self.engine.info.model_name

    async def parse_json(self, raw: Request, model: type[_ModelT]) -> _ModelT:
        """The body as `model` (any pydantic model): a 400 for bad JSON or fields. Only
        the model's own fields are decoded (in C: server/json_body.py), and each list is
        held to its limit before its items are validated (`ListBudgets`)."""
        data = decode_fields(await raw.body(), model, self.config.limits)
        try:
            return model.model_validate(data, context=ListBudgets(self.config.limits))
        except pydantic.ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            raise validation_error(errors, model) from exc

    async def handle(self, raw: Request, route: Callable[[Request], Awaitable[Response]]
                     ) -> Response:
        """`route(raw)`, a generation route; the tenant's seat its `parse` took is released
        here unless the engine took the request (whose end releases it). A request refused
        after its prompt was tokenized is charged the tokens that cost (`Seat.spend`), so
        that no refusal can be repeated for free."""
        try:
            return await route(raw)
        finally:
            admitted: Admitted | None = getattr(raw.state, "admitted", None)
            if admitted is not None and not admitted.submitted:
                admitted.seat.spend(admitted.num_tokenized)
                admitted.seat.release()

    async def parse(
        self, raw: Request, model: type[_RequestT], arrival: float
    ) -> tuple[_RequestT, Admitted]:
        """A generation request's body as `model`, admitted under the request's
        tenant (403 for a priority beyond the tenant's bound, 429 without a seat or room
        in its token rate), after the checks that need no tokens: before any work."""
        request = await self.parse_json(raw, model)
        return request, self.admit(raw, request, arrival)

    def admit(self, raw: Request, request: SamplingRequest, arrival: float) -> Admitted:
        """The checks of a parsed request that need no tokens and its placement under its
        tenant (`parse`'s second half: for a route that translates its body first)."""
        self._check_admission(request)
        admitted = self._place(raw.state.tenant, request, arrival)
        raw.state.admitted = admitted  # for `handle`, which releases its seat
        return admitted

    def take_seat(self, raw: Request, num_tokens: int) -> Seat:
        """A seat of the request's tenant for work that generates nothing (/tokenize,
        /detokenize), taken before the work: a 429 when none is free or its token window
        has no room for `num_tokens`. The caller releases it."""
        tenant: Tenant = raw.state.tenant
        try:
            return tenant.admit(num_tokens)
        except TenantRefused as exc:
            raise self._refused(tenant, exc) from exc

    def reported_model(self, requested: str | None) -> str:
        """The `model` a response reports: the LoRA adapter it ran, or the base model."""
        return requested if requested is not None and requested in self.loras \
            else self.model_name

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is None or a name this server serves (its LoRA adapters'
        included)."""
        if model is not None and model not in self.model_names and model not in self.loras:
            raise APIError(
                404, f"The model `{model}` does not exist; this server serves "
                f"`{self.model_name}`.", param="model", code="model_not_found",
            )

    def _place(self, tenant: Tenant, body: SamplingRequest, arrival: float) -> Admitted:
        """The request's placement, built here once for the engine, and its tenant's seat."""
        lora_name = body.model if body.model in self.loras else None
        if lora_name is not None and not tenant.may_use_lora(lora_name):
            raise APIError(403, f"The tenant `{tenant.name}` may not use the LoRA adapter "
                           f"`{lora_name}`.", param="model", code="lora_not_allowed")
        requested = body.priority if "priority" in body.model_fields_set else None
        try:
            priority = tenant.priority(requested)
        except TenantRefused as exc:
            raise self._refused(tenant, exc) from exc
        if self.engine.info.policy == "fcfs":
            priority = 0  # FCFS orders by arrival alone
        slo = resolve_slo(body.slo, tenant.spec.slo, self.config.default_slo_ttft_ms,
                          self.config.default_slo_tpot_ms)
        if misses_at_the_door(slo, self.engine.soonest_first_token_s()):
            raise self._late_at_the_door(tenant, priority, slo)
        salt = None
        if tenant.cache_salt is not None or body.cache_salt is not None:
            # NOTE: the tenant's part first: no request's own salt can reproduce it.
            salt = f"{tenant.cache_salt or ''}\x00{body.cache_salt or ''}"
        try:
            seat = tenant.admit(_tokens_at_least(body))
        except TenantRefused as exc:
            raise self._refused(tenant, exc) from exc
        placement = Placement(
            priority=priority, tenant=tenant.name, weight=tenant.weight,
            priority_bound=tenant.spec.max_priority,
            deadline=tenant.deadline(arrival, body.deadline_ms), cache_salt=salt,
            ttft_deadline=slo.ttft_deadline(arrival), tpot_s=slo.tpot_s,
            reject_late=slo.reject_late,
            lora_name=lora_name,
        )
        return Admitted(placement, tenant, seat)

    def _late_at_the_door(self, tenant: Tenant, priority: int, slo: ResolvedSlo) -> APIError:
        """503 for a request refused when late that cannot be on time even if it went
        next: before its seat, its tokens or any work (a router may send it elsewhere)."""
        self.engine.metrics.inc_slo_refused(priority, tenant.name)
        return server_error(
            503, f"The first token cannot be within slo.ttft_ms {slo.ttft_ms} ms at the "
            "current load, and the request asked on_miss: reject. Retry later or elsewhere.",
            code="slo_unattainable", headers={"Retry-After": str(self.config.retry_after_s)},
        )

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
        if body.priority != 0 and info.policy == "fcfs":
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

