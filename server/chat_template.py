"""Chat messages (and tools) through a chat template, bounded in time.

A request's own template (`chat_template_kwargs.chat_template`) runs only with
--trust-request-chat-template, and then in a worker process killed at
--chat-template-timeout-s whatever the template does (server/template_worker.py); the
server's (--chat-template) stands in for the model's, and it and the model's, the
operator's code, run in process, stopped at their first Python call past the deadline
(`call_with_deadline`). Each refusal is a 400 naming why.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from server.config import ServerConfig
from server.errors import APIError, server_error
from server.limits import RequestLimits, flag_of, over_limit
from server.requests import ChatCompletionRequest
from server.template_worker import (
    TemplateFailed,
    TemplateTimeout,
    TemplateUnavailable,
    TemplateWorkers,
)

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
    if limits.trust_request_chat_template:
        # NOTE: at the first chat request, so that a request's own template seldom waits
        # for a worker to start (seconds) on the tokenizer thread
        _workers_of(tokenizer).start()
    elif "chat_template" in kwargs:
        raise APIError(
            400, "chat_template_kwargs.chat_template: this server does not run a "
            "request's own chat template; its operator may allow it with "
            f"{flag_of('trust_request_chat_template')}.", param="chat_template_kwargs",
        )
    if body.effective_tool_choice != "none" and body.tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if "chat_template" in kwargs:
        return _render_in_worker(tokenizer, messages, kwargs, add_generation_prompt, limits)
    if config.chat_template is not None:
        kwargs["chat_template"] = config.chat_template
    try:
        text: str = call_with_deadline(
            lambda: tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                **kwargs,
            ),
            limits.chat_template_timeout_s,
        )
    except DeadlineExceeded as exc:
        raise _too_long(limits) from exc
    except Exception as exc:  # jinja errors: the messages do not fit the template
        raise APIError(400, f"Cannot apply the chat template: {exc}", param="messages") from exc
    return text


def _render_in_worker(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                      add_generation_prompt: bool, limits: RequestLimits) -> str:
    """A request's own (trusted) template, rendered by a worker process of `tokenizer`'s
    pool, killed at the deadline."""
    # NOTE: the messages came in a body of at most --max-body-bytes; a template that
    # makes many times that of text is refused in the worker, before it is sent here
    max_chars = _RENDERED_CHARS_PER_BODY_BYTE * limits.max_body_bytes
    try:
        return _workers_of(tokenizer).render(messages, add_generation_prompt, kwargs,
                                             limits.chat_template_timeout_s, max_chars)
    except TemplateTimeout as exc:
        raise _too_long(limits) from exc
    except TemplateFailed as exc:
        raise APIError(400, f"Cannot apply the chat template: {exc}", param="messages") from exc
    except TemplateUnavailable as exc:
        raise server_error(503, f"The request's chat template cannot be rendered now: {exc}",
                           code="template_worker_unavailable") from exc


def _too_long(limits: RequestLimits) -> APIError:
    return APIError(400, over_limit(
        "the chat template took too long to render (seconds)",
        limits.chat_template_timeout_s, "chat_template_timeout_s",
    ), param="messages")


_RENDERED_CHARS_PER_BODY_BYTE = 4
_workers: dict[int, TemplateWorkers] = {}  # by id(tokenizer), while the tokenizer lives
_workers_lock = threading.Lock()


def _workers_of(tokenizer: Any) -> TemplateWorkers:
    """The worker pool rendering with `tokenizer` (made at its first trusted template, closed
    when the tokenizer is collected)."""
    key = id(tokenizer)
    with _workers_lock:
        workers = _workers.get(key)
        if workers is None:
            workers = _workers[key] = TemplateWorkers(tokenizer)
            weakref.finalize(tokenizer, _close_workers, key)
        return workers


def _close_workers(key: int) -> None:
    with _workers_lock:
        workers = _workers.pop(key, None)
    if workers is not None:
        workers.close()


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
    """Whether `frame` runs for the garbage collector (in a collection, or in any gc
    callback, this module's note of it included) or inside a `__del__`."""
    if _collection.running:
        return True
    # NOTE: every gc callback, not only ours: one appended after ours (hypothesis has one)
    # runs at the end of a collection after ours has noted it over
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code in callbacks:
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

