"""The Responses API's objects (POST /v1/responses), whole and as their event stream.

A response is what its request asked for (`ResponseHead`: the fields echoed back), its
output items and usage. The output items come from a choice's text as the chat route
parses it (server/chat_output.py): `reasoning` (one reasoning_text part), `message` (one
output_text part) and `function_call` items, in the order the model wrote them.
Non-streamed, `output_items` builds them from the parsed text; streamed, `ResponseEvents`
turns the same parser's deltas into OpenAI's events: response.created and
response.in_progress, then for each item response.output_item.added, its part's
response.content_part.added, the deltas (response.output_text.delta,
response.reasoning_text.delta, response.function_call_arguments.delta), their .done
event, response.content_part.done and response.output_item.done, and at the end
response.completed carrying the whole response (also when it is incomplete: its status
says so). `sequence_number` counts the events from 0; an item's id is the same in each
of its events and in the final response. Events are written as plain dicts with orjson:
OpenAI's client types check their shapes in the tests.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine.outputs import EngineStepError
from server.chat_output import ParsedChat
from server.rendering import Choice, usage
from server.responses import DeltaMessage, DeltaToolCall
from server.responses_request import FunctionToolChoice, ResponsesRequest

Item = dict[str, Any]

# finish_reason -> (the response's status, incomplete_details.reason)
_STATUS: dict[str | None, tuple[str, str | None]] = {
    "stop": ("completed", None),
    "tool_calls": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "deadline": ("incomplete", None),
    "rejected": ("incomplete", None),
    "abort": ("cancelled", None),
}


def item_id(prefix: str) -> str:
    """An id in OpenAI's style: `resp_...`, `msg_...`, `rs_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseHead:
    """A response's id, creation time, model and the request's fields it echoes."""

    id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, status: str, output: list[Item], usage_: dict[str, Any] | None,
        incomplete_reason: str | None = None,
    ) -> dict[str, Any]:
        """The response object."""
        incomplete = None if status != "incomplete" else {"reason": incomplete_reason}
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output, "usage": usage_,
                "error": None, "incomplete_details": incomplete, **self.echo}


def response_head(body: ResponsesRequest, response_id: str, model: str) -> ResponseHead:
    """The head of `body`'s response: what it asked for, defaults filled in."""
    choice = body.tool_choice
    text_format = body.text.format if body.text is not None else None
    return ResponseHead(response_id, model, {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": body.reasoning,
        "store": False,
        "background": False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": {"type": "text"} if text_format is None
                 else text_format.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": (choice.model_dump() if isinstance(choice, FunctionToolChoice)
                        else choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "truncation": "disabled",
        "user": body.user,
    })


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete_details.reason) of a response whose choice ended so."""
    return _STATUS.get(finish_reason, ("completed", None))


def response_usage(prompt: list[int], choice: Choice) -> dict[str, Any]:
    """The Responses shape of a choice's usage, with whether each latency target it
    carried was met (`slo`; the other routes say it on the choice: a response has none)."""
    u = usage([prompt], [choice])
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    # NOTE: no tokens are written to a cache on request (OpenAI's explicit caching)
    shape = {"input_tokens": u.prompt_tokens,
             "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
             "output_tokens": u.completion_tokens,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u.total_tokens}
    return shape if choice.slo is None else {**shape, "slo": choice.slo}


# ------------------------------------------------------------------ items


def _text_part(kind: str, text: str) -> Item:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _text_item(kind: str, id_: str, status: str) -> Item:
    """A reasoning or message item, its content still empty."""
    if kind == "reasoning":
        return {"id": id_, "type": "reasoning", "summary": [], "content": [], "status": status}
    return {"id": id_, "type": "message", "role": "assistant", "content": [], "status": status}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> Item:
    return {"id": item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(parsed: ParsedChat, last_status: str) -> list[Item]:
    """The output items of a parsed choice: reasoning, the message, then the function
    calls (an empty message when there is nothing else); the last item's status is
    `last_status` (the others are complete)."""
    items = []
    content = parsed.content if parsed.content or not (parsed.reasoning or parsed.tool_calls) \
        else None  # an empty message only when nothing else is there
    for kind, text in (("reasoning", parsed.reasoning), ("message", content)):
        if text is not None:
            item = _text_item(kind, item_id("rs" if kind == "reasoning" else "msg"),
                              "completed")
            item["content"].append(_text_part(kind, text))
            items.append(item)
    items += [_call_item(c.id, c.function.name, c.function.arguments, "completed")
              for c in parsed.tool_calls]
    if items:
        items[-1]["status"] = last_status
    return items


# ------------------------------------------------------------------ events


class ResponseEvents:
    """The events of one streamed response: `start`, then `feed` per parsed delta, then
    `finish` (or `error`); each returns the SSE bytes to send."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.output: list[Item] = []
        self._index: dict[str, int] = {}  # an item's output_index by its id
        self._sequence = 0
        self._text: tuple[Item, list[str]] | None = None  # the open text item and its text
        self._calls: dict[int, Item] = {}  # open function calls by their delta index

    def start(self) -> bytes:
        response = self.head.response("in_progress", [], None)
        return (self._event("response.created", response=response)
                + self._event("response.in_progress", response=response))

    def feed(self, delta: DeltaMessage) -> bytes:
        """The events of a delta of the chat output parser (or of plain text)."""
        # NOTE: the open calls' arguments first: what follows them in the text (reasoning
        # or content) closes them.
        open_calls: list[DeltaToolCall] = []
        new_calls: list[DeltaToolCall] = []
        for call in delta.tool_calls or ():
            (open_calls if call.index in self._calls else new_calls).append(call)
        out = [self._call_delta(c) for c in open_calls]
        if delta.reasoning_content:
            out.append(self._text_delta("reasoning", delta.reasoning_content))
        if delta.content:
            out.append(self._text_delta("message", delta.content))
        out += [self._call_delta(c) for c in new_calls]
        return b"".join(out)

    def finish(self, finish_reason: str | None, usage_: dict[str, Any]) -> bytes:
        """The open items closed, then response.completed with the whole response."""
        status, reason = status_of(finish_reason)
        last = "incomplete" if status == "incomplete" else "completed"
        out = [] if self.output else [self._open_text("message")]  # as `output_items`
        out += [self._close_text(last), self._close_calls(last)]
        response = self.head.response(status, self.output, usage_, reason)
        out.append(self._event("response.completed", response=response))
        return b"".join(out)

    def error(self, error: EngineStepError) -> bytes:
        """The error event of a failed step."""
        kind = "invalid_request_error" if error.status_code == 400 else "server_error"
        return self._event("error", code=kind, message=str(error), param=None)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _add(self, item: Item) -> bytes:
        self._index[item["id"]] = len(self.output)
        self.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1,
                           item=item)

    def _open_text(self, kind: str) -> bytes:
        """A new reasoning or message item (the open items closed first)."""
        out = [self._close_text("completed"), self._close_calls("completed")]
        item = _text_item(kind, item_id("rs" if kind == "reasoning" else "msg"), "in_progress")
        out.append(self._add(item))
        out.append(self._event("response.content_part.added", **self._where(item),
                               part=_text_part(kind, "")))
        self._text = (item, [])
        return b"".join(out)

    def _text_delta(self, kind: str, text: str) -> bytes:
        out = []
        if self._text is None or self._text[0]["type"] != kind:
            out.append(self._open_text(kind))
        assert self._text is not None
        item, texts = self._text
        texts.append(text)
        delta_type = ("response.reasoning_text.delta" if kind == "reasoning"
                      else "response.output_text.delta")
        extra: dict[str, list[object]] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self._event(delta_type, **self._where(item), delta=text, **extra))
        return b"".join(out)

    def _close_text(self, status: str) -> bytes:
        if self._text is None:
            return b""
        item, texts = self._text
        self._text = None
        kind = "reasoning" if item["type"] == "reasoning" else "message"
        text = "".join(texts)
        part = _text_part(kind, text)
        item["content"].append(part)
        item["status"] = status if item is self.output[-1] else "completed"
        done_type = ("response.reasoning_text.done" if kind == "reasoning"
                     else "response.output_text.done")
        extra: dict[str, list[object]] = {} if kind == "reasoning" else {"logprobs": []}
        return (self._event(done_type, **self._where(item), text=text, **extra)
                + self._event("response.content_part.done", **self._where(item), part=part)
                + self._event("response.output_item.done",
                              output_index=self._index[item["id"]], item=item))

    def _call_delta(self, call: DeltaToolCall) -> bytes:
        out = []
        item = self._calls.get(call.index)
        if item is None:
            if call.function.name is None:
                return b""  # more arguments of a call closed already: it cannot change
            out.append(self._close_text("completed"))
            item = _call_item(call.id or item_id("call"), call.function.name, "",
                              "in_progress")
            self._calls[call.index] = item
            out.append(self._add(item))
        if call.function.arguments:
            item["arguments"] += call.function.arguments
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=item["id"], output_index=self._index[item["id"]],
                                   delta=call.function.arguments))
        return b"".join(out)

    def _close_calls(self, status: str) -> bytes:
        out = []
        for item in self._calls.values():
            item["status"] = status if item is self.output[-1] else "completed"
            index = self._index[item["id"]]
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=item["name"],
                                   arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        self._calls.clear()
        return b"".join(out)

    def _where(self, item: Item) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index[item["id"]],
                "content_index": 0}
