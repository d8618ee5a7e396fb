"""Chat messages (and tools) through a chat template, bounded in time.

A request's own template (`chat_template_kwargs.chat_template`) runs only with
--trust-request-chat-template; the server's (--chat-template) stands in for the model's;
every template stops at --chat-template-timeout-s (`call_with_deadline`). Each refusal is
a 400 naming why.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from server.config import ServerConfig
from server.errors import APIError
from server.limits import flag_of, over_limit
from server.requests import ChatCompletionRequest

_T = TypeVar("_T")


def apply_chat_template(
    tokenizer: Any, body: ChatCompletionRequest, config: ServerConfig,
    add_generation_prompt: bool,
) -> str:
    """The text of `body`'s messages (and tools) through `tokenizer`'s chat template, or
    the one `config` or the request names; a 400 when the template rejects them, takes
    longer than --chat-template-timeout-s, or is the request's own and not trusted."""
    limits = config.limits
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
    if config.chat_template is not None:
        kwargs.setdefault("chat_template", config.chat_template)
    try:
        text: str = call_with_deadline(
            lambda: tokenizer.apply_chat_template(
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
    return text


class DeadlineExceeded(BaseException):
    """Raised inside a call that ran past its deadline (`call_with_deadline`).

    NOTE: a BaseException, so that no `except Exception` on the way (jinja has some)
    swallows it."""


class _Collection(threading.local):
    """Whether the garbage collector is running on this thread (its finalizers and
    weakref callbacks, which may be any thread's objects')."""

    running = False


_collection = _Collection()


def _note_collection(phase: str, info: dict[str, Any]) -> None:
    _collection.running = phase == "start"


gc.callbacks.append(_note_collection)


def _in_finalizer(frame: Any) -> bool:
    """Whether `frame` runs for the garbage collector (this module's note of it included)
    or inside a `__del__`."""
    if _collection.running or frame.f_code is _note_collection.__code__:
        return True
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def call_with_deadline(
    fn: Callable[[], _T], timeout_s: float, clock: Callable[[], float] = time.monotonic
) -> _T:
    """`fn()`, stopped with DeadlineExceeded at its first Python call past `timeout_s`.

    NOTE: a trace hook on this thread that looks only at "call" events (it returns None,
    so no line is traced): jinja templates compile to Python, whose loops call (range,
    filters, the output generator), so a template cannot run long without one. A loop of
    C code alone (a huge string's characters) is not stopped before it ends. Finalizers
    that run meanwhile (the collector's, or a `__del__`) are never stopped: they may be
    another thread's objects' (an HTTP stream's), and an exception there is swallowed
    with their cleanup half done."""
    deadline = clock() + timeout_s

    def trace(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and clock() > deadline and not _in_finalizer(frame):
            raise DeadlineExceeded
        return None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn()
    finally:
        sys.settrace(previous)

