"""The small routes clients use for budgets and checks, and the X-Request-Id header.

POST /tokenize (a prompt, or chat messages rendered with the template) and POST
/detokenize answer in vLLM's shapes, each in a seat of the tenant, its tokens counted in
the tenant's token window as a prompt's are; GET /version gives the package version.
`RequestIdMiddleware` returns the client's `X-Request-Id` (or a new one) on every
response and logs it with the route, so a client's id can be found in the server log.
"""

from __future__ import annotations

import importlib.metadata
import logging
import uuid
from typing import TYPE_CHECKING, Annotated, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError
from server.rendering import json_response
from server.request_fields import limited
from server.requests import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    JsonInt,
    _Request,
)

if TYPE_CHECKING:
    from server.serving import Serving

logger = logging.getLogger(__name__)

MAX_DETOKENIZE_TOKENS = 2**20


class TokenizeRequest(_Request):
    """vLLM's /tokenize: `prompt`, or `messages` (with tools and template kwargs)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, limited("max_messages", "messages")] = Field(
        default=None, min_length=1, fail_fast=True)
    tools: Annotated[list[ChatTool] | None, limited("max_tools", "tools")] = Field(
        default=None, fail_fast=True)
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[JsonInt] = Field(max_length=MAX_DETOKENIZE_TOKENS, fail_fast=True)


class DetokenizeResponse(BaseModel):
    prompt: str


def install_utility_routes(app: FastAPI, api: Serving) -> None:
    check_model = api.check_model

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(raw: Request) -> Response:
        body = await api.parse_json(raw, TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of prompt and messages.", param="prompt")
        # NOTE: the tenant's seat before the work, and the tokens counted once known (the
        # work is done: never refused after it), as for a prompt
        seat = api.take_seat(raw, 1)
        try:
            tokens = await _tokenize(api, body)
            seat.spend(len(tokens))
            # NOTE: written on a render thread: the answer of a long text is megabytes
            content = await api.off_loop(_tokenize_json, tokens, api.engine.info.max_model_len)
        finally:
            seat.release()
        return json_response(content)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> DetokenizeResponse:
        body = await api.parse_json(raw, DetokenizeRequest)
        check_model(body.model)
        vocab_size = api.engine.info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of range: the vocabulary has "
                           f"{vocab_size} tokens.", param="tokens")
        seat = api.take_seat(raw, len(body.tokens))
        try:
            seat.spend(len(body.tokens))
            texts = await api.in_pool(api.decode_all, [body.tokens])
        finally:
            seat.release()
        return DetokenizeResponse(prompt=texts[0])

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("pagedserve")}


async def _tokenize(api: Serving, body: TokenizeRequest) -> list[int]:
    """The prompt's tokens, or the messages' through the chat template, on the tokenizer
    thread."""
    if body.messages is not None:
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
        return await api.in_pool(api.render_chat, chat, body.add_generation_prompt)
    api.check_prompt_chars(body.prompt or "", "prompt", "prompt")
    return await api.in_pool(api.encode, body.prompt, body.add_special_tokens)


def _tokenize_json(tokens: list[int], max_model_len: int) -> bytes:
    """A `TokenizeResponse`'s JSON."""
    return orjson.dumps({"count": len(tokens), "max_model_len": max_model_len,
                         "tokens": tokens})


class RequestIdMiddleware:
    """Echoes `X-Request-Id` (a new one when the client sent none) on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given.decode("latin-1")[:256] if given else uuid.uuid4().hex
        if given:
            logger.info("%s %s X-Request-Id: %s", scope["method"], scope["path"], request_id)
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)
