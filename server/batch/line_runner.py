"""One batch line run as the live route runs a request: its body handed to the route's
own handler (`Serving.handle`: parse, budgets, tenant seat, structured outputs, submit,
collect) as the body of a request of the batch's tenant, at the batch priority.

A line ends as an output-file line (200), an error-file line (the route's 4xx or 5xx), or
not at all: `Retry` when the server has no room for it now (429, 503) or aborted it (the
server stopping), which leaves it pending for the feeder to send again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Message

from server.admission import Admission
from server.errors import APIError
from server.tenants import Tenant

logger = logging.getLogger(__name__)

Route = Callable[[Request], Awaitable[Response]]
_RETRY_STATUSES = (429, 503)  # no seat, no rate, overloaded, engine down: later


class Retry(Exception):
    """The line found no room (a tenant seat, the engine): it stays pending."""


@dataclass(frozen=True)
class LineResult:
    status_code: int
    body: Any  # the route's JSON response, or OpenAI's error object

    @property
    def is_done(self) -> bool:
        return self.status_code == 200


class LineRunner:
    """Runs lines through the live routes (path -> the route's handler)."""

    def __init__(self, serving: Admission, routes: dict[str, Route], priority: int) -> None:
        self._serving = serving
        self._routes = routes
        self._priority = priority

    async def run(self, endpoint: str, body_json: str, tenant: Tenant) -> LineResult:
        """The line's response (raises `Retry` to leave it pending; cancelled: the route
        aborts its engine request and releases its seat, as for a client gone away)."""
        raw = line_request(endpoint, self._body(body_json), tenant)
        try:
            response = await self._serving.handle(raw, self._routes[endpoint])
        except APIError as exc:
            if exc.status_code in _RETRY_STATUSES:
                raise Retry(str(exc)) from exc
            return LineResult(exc.status_code, {"error": exc.info.model_dump()})
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("a batch line failed")
            return LineResult(500, {"error": {"message": "The line failed on the server.",
                                              "type": "server_error", "param": None,
                                              "code": None}})
        body = json.loads(bytes(response.body))
        if any(c.get("finish_reason") == "abort" for c in body.get("choices", ())):
            raise Retry("aborted in the engine (the server is stopping)")
        return LineResult(response.status_code, body)

    def _body(self, body_json: str) -> bytes:
        """The line's body at the batch priority (under FCFS: the one priority), never
        streamed."""
        body = json.loads(body_json)
        body.pop("stream", None)
        body.pop("priority", None)
        if self._serving.engine.info.policy != "fcfs":
            body["priority"] = self._priority
        return json.dumps(body).encode()


def line_request(path: str, body: bytes, tenant: Tenant) -> Request:
    """A POST of `body` to `path` by `tenant`, as the middleware hands it to a route; its
    client never goes away (a line ends by its task being cancelled)."""
    scope = {
        "type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
        "query_string": b"", "headers": [(b"content-type", b"application/json")],
        "state": {"tenant": tenant}, "http_version": "1.1", "scheme": "http",
        "server": None, "client": None, "root_path": "",
    }
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the line's task is cancelled instead
        raise AssertionError("unreachable")

    return Request(scope, receive)
