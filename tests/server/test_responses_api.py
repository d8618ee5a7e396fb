"""POST /v1/responses over the scripted engine (its script plays the model's output): the
Responses objects and event stream as OpenAI's client types read them (order, sequence
numbers, item ids, the final response.completed), text, reasoning, function calls and
json_schema, the input items as chat messages, and every refusal a 400 in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Callable

import jsonschema
import openai
import pydantic
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent

from server.config import ServerConfig
from server.responses import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from server.responses_events import ResponseEvents, response_head
from server.responses_request import ResponsesRequest, chat_messages
from tests.support.engine_helpers import step_faults
from tests.support.reliability_helpers import assert_openai_error
from tests.support.structured_helpers import MaskedRandomRunner, make_structured

TOOLS = [{"type": "function", "name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}]
BOUNDED = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
           "additionalProperties": False}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
ITEM_EVENTS = {  # an item's events after output_item.added, by the item's type
    "message": ["response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done",
                "response.output_item.done"],
    "reasoning": ["response.content_part.added", "response.reasoning_text.delta",
                  "response.reasoning_text.done", "response.content_part.done",
                  "response.output_item.done"],
    "function_call": ["response.function_call_arguments.delta",
                      "response.function_call_arguments.done", "response.output_item.done"],
}


@pytest.fixture
def serve(make_fake_engine, open_client) -> Callable[..., TestClient]:
    def make(script: str = "Hello.", structured: bool = False, policy: str = "fcfs",
             **config) -> TestClient:
        if structured:
            engine = make_fake_engine(runner=MaskedRandomRunner(), structured=make_structured(),
                                      start=False, policy=policy)
        else:
            engine = make_fake_engine(script=script, start=False, policy=policy)
        return open_client(engine, ServerConfig(**config))

    return make


def stream_events(client: TestClient, body: dict) -> list:
    """The stream's events, each read by OpenAI's client types (which checks its shape)."""
    events = []
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    for kind, data in zip(lines[::2], lines[1::2], strict=True):
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        events.append(event)
    return events


def check_stream(events: list) -> Response:
    """The events in the Responses order, numbered from 0, each item's events (by output
    index) added, its part, its deltas, done, all naming its id; returns the final
    response, whose items are those the items' done events carried."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    response = events[-1].response
    assert {e.response.id for e in (events[0], events[1])} == {response.id}
    by_index: dict[int, list] = {}
    for event in events[2:-1]:
        by_index.setdefault(event.output_index, []).append(event)
    assert list(by_index) == list(range(len(by_index)))
    done = []
    for added, *rest in by_index.values():
        assert added.type == "response.output_item.added" and added.item.status == "in_progress"
        expected = ITEM_EVENTS[added.item.type]
        delta = next(k for k in expected if k.endswith(".delta"))
        kinds = [e.type for e in rest]
        at = expected.index(delta)
        assert kinds == expected[:at] + [delta] * kinds.count(delta) + expected[at + 1:]
        assert all(getattr(e, "item_id", added.item.id) == added.item.id for e in rest)
        assert rest[-1].item.id == added.item.id
        done.append(rest[-1].item)
    assert [i.model_dump() for i in response.output] == [i.model_dump() for i in done]
    return response


def test_text_whole_and_streamed_with_the_openai_client_types(serve) -> None:
    client = serve(script="Hello, wörld!")
    body = {"input": "hi", "instructions": "Be brief.", "max_output_tokens": 50,
            "temperature": 0, "metadata": {"k": "v"}}
    whole = Response.model_validate(client.post("/v1/responses", json=body).json())
    assert whole.status == "completed" and whole.output_text == "Hello, wörld!"
    assert whole.id.startswith("resp_") and whole.instructions == "Be brief."
    assert whole.temperature == 0 and whole.max_output_tokens == 50
    assert whole.metadata == {"k": "v"} and whole.store is False
    # "<system>Be brief.\n<user>hi\n<assistant>": the byte tokenizer's template
    assert whole.usage.input_tokens == len("<system>Be brief.\n<user>hi\n<assistant>")
    assert whole.usage.output_tokens == len("Hello, wörld!".encode()) + 1  # and EOS
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = stream_events(client, body)
    streamed = check_stream(events)
    assert streamed.output_text == "Hello, wörld!"
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens)
    assert streamed.usage.input_tokens_details.cached_tokens > 0  # the prompt, again
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == "Hello, wörld!"
    assert [i.type for i in streamed.output] == ["message"]


def test_reasoning_and_a_function_call_whole_and_streamed(serve) -> None:
    client = serve(script="<think>hmm</think>Sure. " + CALL, tool_call_parser="hermes",
                   reasoning_parser="qwen3")
    body = {"input": "add one", "tools": TOOLS}
    whole = Response.model_validate(client.post("/v1/responses", json=body).json())
    streamed = check_stream(stream_events(client, body))
    for response in (whole, streamed):
        reasoning, message, call = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "hmm"
        assert message.content[0].text == "Sure. "
        assert (call.type, call.name, json.loads(call.arguments)) == (
            "function_call", "add", {"a": 1})
        assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
        assert response.tools[0].name == "add" and response.tool_choice == "auto"


def test_the_openai_client_streams_and_parses_a_forced_call(serve) -> None:
    client = serve(structured=True, tool_call_parser="hermes")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                        max_retries=0)
    tools = [{**TOOLS[0], "parameters": BOUNDED}]  # random tokens: keep the call short
    with sdk.responses.stream(model="fake-model", input="add", tools=tools,
                              tool_choice={"type": "function", "name": "add"},
                              max_output_tokens=60, parallel_tool_calls=False) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and call.name == "add"
    jsonschema.validate(json.loads(call.arguments), BOUNDED)
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"


def test_json_schema_text_format_validates_whole_and_streamed(serve) -> None:
    client = serve(structured=True)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 99}, "s": {"enum": ["x", "y"]}}, "required": ["n", "s"],
              "additionalProperties": False}
    body = {"input": "json", "max_output_tokens": 60,
            "text": {"format": {"type": "json_schema", "name": "thing", "schema": schema}}}
    whole = Response.model_validate(client.post("/v1/responses", json=body).json())
    streamed = check_stream(stream_events(client, body))
    for response in (whole, streamed):
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text.format.type == "json_schema" and response.text.format.name == "thing"


def call_delta(index: int, arguments: str, name: str | None = None) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=f"call_{index}" if name else None,
                         function=DeltaFunctionCall(name=name, arguments=arguments))


def test_interleaved_calls_and_text_keep_their_items_apart() -> None:
    events = ResponseEvents(response_head(ResponsesRequest(input="x"), "resp_1", "m"))
    deltas = [
        DeltaMessage(content="Sure."),
        DeltaMessage(tool_calls=[call_delta(0, "", "a"), call_delta(0, '{"x"')]),
        DeltaMessage(tool_calls=[call_delta(1, "", "b"), call_delta(0, ": 1}")]),
        DeltaMessage(tool_calls=[call_delta(1, "{}")], content="Done."),
        DeltaMessage(tool_calls=[call_delta(0, " ")]),  # a closed call's: dropped
    ]
    body = events.start() + b"".join(events.feed(d) for d in deltas) + events.finish(
        "stop", {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0,
                 "cache_write_tokens": 0}, "output_tokens": 2,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 3})
    lines = [line for line in body.decode().splitlines() if line]
    response = check_stream([EVENTS.validate_python(json.loads(line[6:]))
                             for line in lines[1::2]])
    assert [(i.type, getattr(i, "name", None)) for i in response.output] == [
        ("message", None), ("function_call", "a"), ("function_call", "b"), ("message", None)]
    assert [i.arguments for i in response.output[1:3]] == ['{"x": 1}', "{}"]
    assert response.output[1].call_id == "call_0" and response.output_text == "Sure.Done."


def test_max_output_tokens_makes_an_incomplete_response(serve) -> None:
    client = serve(script="Hello, world!")
    body = {"input": "hi", "max_output_tokens": 3}
    whole = Response.model_validate(client.post("/v1/responses", json=body).json())
    streamed = check_stream(stream_events(client, body))
    for response in (whole, streamed):
        assert response.status == "incomplete" and response.output_text == "Hel"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[-1].status == "incomplete"


def test_input_items_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate({"instructions": "sys", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "add 1"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "so"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Calling.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "2"},
        {"role": "assistant", "content": "It is 2."},
    ]})
    assert chat_messages(body) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "add 1"},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "so",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "assistant", "content": "It is 2."},
    ]


def test_a_function_call_output_round_trip_is_served(serve) -> None:
    client = serve(script="It is 2.", tool_call_parser="hermes")
    response = client.post("/v1/responses", json={"tools": TOOLS, "input": [
        {"role": "user", "content": "add 1"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "2"}]})
    assert Response.model_validate(response.json()).output_text == "It is 2."
    rendered = "<user>add 1\n<assistant>\n<tool>2\n<assistant>"  # the byte tokenizer's
    assert response.json()["usage"]["input_tokens"] == len(rendered)


def test_a_failing_step_ends_the_stream_with_an_error_event(make_fake_engine,
                                                          open_client) -> None:
    engine = make_fake_engine(start=False)
    client = open_client(engine, ServerConfig())
    steps = []

    def fail_third(plan) -> None:
        steps.append(plan)
        if len(steps) == 3:
            raise RuntimeError("injected")

    step_faults(engine).on_launch = fail_third
    events = stream_events(client, {"input": "hi"})
    assert events[-1].type == "error" and "error id" in events[-1].message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_text.delta" in [e.type for e in events]
    state = client.get("/scheduler/state").json()
    assert not state["running"] and not state["waiting"] and state["kv_cache"]["usage"] == 0
    assert client.post("/v1/responses", json={"input": "hi"}).json()["status"] == "completed"


BAD = [
    ({"input": "hi", "store": True}, "store", "store: true is not supported"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": ""}, "input", "at least 1 character"),
    ({"input": []}, "input", "at least 1"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "'input_image' are not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "mul"}},
     None, "'mul', which is not in tools"),
    ({"input": "hi", "tool_choice": "required"}, None, "needs tools"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ({"input": "hi", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"input": "hi", "temperature": "0.5"}, "temperature", "valid number"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
     "needs a schema"),
    ({"input": "hi", "priority": -1}, "priority", "--scheduling-policy priority"),
    ({"input": "hi", "model": "gpt-4o"}, "model", "does not exist"),
    ({"input": "x" * 200}, "prompt", "maximum context length"),
]


@pytest.mark.parametrize(("body", "param", "needle"), BAD)
def test_bad_requests_are_400_in_openais_shape(serve, body, param, needle) -> None:
    error = assert_openai_error(serve().post("/v1/responses", json=body), None, needle)
    assert error["param"] == param


def test_tool_choice_auto_needs_a_tool_call_parser(serve) -> None:
    response = serve().post("/v1/responses", json={"input": "hi", "tools": TOOLS})
    assert_openai_error(response, 400, "--tool-call-parser")


def test_priority_is_taken_under_the_priority_policy(serve) -> None:
    response = serve(policy="priority").post("/v1/responses",
                                             json={"input": "hi", "priority": -5})
    assert response.status_code == 200 and response.json()["status"] == "completed"
