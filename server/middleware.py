"""ASGI middleware of the HTTP server: the tenant behind the API key, the body's size and
arrival time, and the last resort for an unexpected exception.

Each answers in OpenAI's error shape (server/errors.py) before a route runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, server_error
from server.limits import over_limit
from server.responses import random_id
from server.tenants import TenantRegistry

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})


class InternalErrorMiddleware:
    """An exception no handler answered: logged with its traceback under a fresh error id,
    answered with a 500 that names the id (never the exception's text), and not re-raised,
    so the log holds it once. Mid-stream, the connection just ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            error_id = random_id("err")
            logger.exception("internal error %s on %s %s", error_id, scope.get("method"),
                             scope.get("path"))
            if not started:
                error = server_error(
                    500, f"Internal server error (error id {error_id}; the server log has "
                    "the details).", code="internal_error",
                )
                await error.response()(scope, receive, send)


class TenantAuthMiddleware:
    """Who is asking: the tenant of `Authorization: Bearer <key>` goes into the request's
    state (`request.state.tenant`); 401 for every path but /health and /metrics without
    a known key when keys are required (server/tenants.py). /metrics stays open (what
    Prometheus expects) unless `metrics_key` is given: then it takes that key alone. Where
    a key is read, two Authorization headers are a 400, whatever they hold.

    A key is looked up by its sha256, never compared or logged as it is.
    """

    def __init__(self, app: ASGIApp, tenants: TenantRegistry,
                 metrics_key: str | None = None) -> None:
        self.app = app
        self._tenants = tenants
        self._metrics_digest = (hashlib.sha256(metrics_key.encode()).digest()
                                if metrics_key is not None else None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        digest = self._metrics_digest
        reads_key = path not in OPEN_PATHS or (path == "/metrics" and digest is not None)
        if reads_key and _num_authorization_headers(scope) > 1:
            # NOTE: a proxy in front may check the first one, while a lookup reads the last
            error = APIError(400, "The request has more than one Authorization header; send "
                             "one: 'Authorization: Bearer <key>'.", param="Authorization",
                             code="duplicate_authorization_header")
            await error.response()(scope, receive, send)
            return
        if path == "/metrics" and digest is not None:
            given = hashlib.sha256(_bearer_token(scope) or b"").digest()
            if not hmac.compare_digest(given, digest):
                await _unauthorized("Invalid or missing metrics key: send 'Authorization: "
                                    "Bearer <key>' with the key of --metrics-api-key.",
                                    scope, receive, send)
                return
        elif path not in OPEN_PATHS:
            tenant = self._tenants.identify(_bearer_token(scope))
            if tenant is None:
                await _unauthorized("Invalid or missing API key: send 'Authorization: "
                                    "Bearer <key>'.", scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


async def _unauthorized(message: str, scope: Scope, receive: Receive, send: Send) -> None:
    error = APIError(401, message, code="invalid_api_key",
                     headers={"WWW-Authenticate": "Bearer"})
    await error.response()(scope, receive, send)


def _num_authorization_headers(scope: Scope) -> int:
    return sum(1 for name, _ in scope["headers"] if name.lower() == b"authorization")


def _bearer_token(scope: Scope) -> bytes | None:
    given = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = given.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class BodyLimitMiddleware:
    """413 for request bodies over max_bytes (or a path's own limit in `path_limits`:
    path -> (bytes, the limit's field name)), by Content-Length or as they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 path_limits: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self._max_bytes = max_bytes
        self._path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, name = self._path_limits.get(scope["path"], (self._max_bytes, "max_body_bytes"))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _too_large(limit, name).response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit, name)
            return message

        await self.app(scope, limited_receive, send)


def _too_large(limit: int, name: str) -> APIError:
    return APIError(413, over_limit(f"Request body is larger than {limit} bytes", limit, name),
                    code="request_too_large")


class BodyTimeoutMiddleware:
    """408 when a request body has not fully arrived within timeout_s (a client that
    sends its body slowly, or not at all, holds no handler for long)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self._timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self._timeout_s
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(_loop_deadline(deadline)):
                    message = await receive()
            except TimeoutError:
                raise APIError(
                    408, f"The request body did not arrive within {self._timeout_s:g} s.",
                    code="request_timeout",
                ) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, timed_receive, send)


def _loop_deadline(monotonic_deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())
