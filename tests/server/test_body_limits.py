"""The body parser's bounds over HTTP on the scripted engine: each list limit of the
request models (server/limits.py) at its value is served and one past it is a 400 naming
its flag, --max-json-values is counted on the bytes before anything is decoded, unknown
fields are never decoded, the JSON errors are 400s saying why (server/json_body.py), and a
validation error names its first problems in the body's terms, in a bounded message
(server/errors.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pydantic
import pytest
from fastapi.testclient import TestClient

from server.config import ServerConfig
from server.errors import validation_error
from server.json_body import _num_values, decode_fields
from server.limits import RequestLimits, flag_of
from server.requests import CompletionRequest
from tests.support.reliability_helpers import assert_openai_error
from tests.support.structured_helpers import MaskedRandomRunner, make_structured

LIMITS = RequestLimits(max_prompt_token_ids=20, max_messages=3, max_content_parts=4,
                       max_stop_token_ids=3, max_allowed_token_ids=5, max_choice_strings=3,
                       max_tools=2, max_json_values=300)
USER = {"role": "user", "content": "hi"}
PART = {"type": "text", "text": "h"}
INPUT_PART = {"type": "input_text", "text": "h"}
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
          "responses": "/v1/responses", "tokenize": "/tokenize"}


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# (limit field, route, the field named, body asking for `amount` of what the limit bounds)
LISTS: list[tuple[str, str, str, Callable[[int], dict[str, Any]]]] = [
    ("max_prompt_token_ids", "completions", "prompt", lambda a: {"prompt": [104] * a}),
    ("max_prompt_token_ids", "completions", "prompt",  # all prompts together
     lambda a: {"prompt": [[104] * (a // 2), [104] * (a - a // 2)]}),
    ("max_messages", "chat", "messages", lambda a: {"messages": [USER] * a}),
    ("max_messages", "responses", "input", lambda a: {"input": [USER] * a}),
    ("max_messages", "tokenize", "messages", lambda a: {"messages": [USER] * a}),
    ("max_content_parts", "chat", "messages",  # all messages together
     lambda a: {"messages": [{"role": "user", "content": [PART] * (a - 1)},
                             {"role": "user", "content": [PART]}]}),
    ("max_content_parts", "responses", "input",  # a reasoning item's summary among them
     lambda a: {"input": [{"type": "reasoning", "summary": [{"text": "h"}] * (a - 1)},
                          {"role": "user", "content": [INPUT_PART]}]}),
    ("max_stop_token_ids", "completions", "stop_token_ids",
     lambda a: {"prompt": "hi", "stop_token_ids": [1] * a}),
    ("max_allowed_token_ids", "completions", "allowed_token_ids",
     lambda a: {"prompt": "hi", "allowed_token_ids": [72] * a}),
    ("max_tools", "tokenize", "tools",
     lambda a: {"messages": [USER], "tools": [tool(f"f{i}") for i in range(a)]}),
]


@pytest.fixture
def client(make_fake_engine, open_client) -> TestClient:
    return open_client(make_fake_engine(), ServerConfig(limits=LIMITS))


def post(client: TestClient, route: str, body: dict[str, Any]) -> Any:
    if route != "tokenize":
        body = {"max_tokens": 2, **body} if route != "responses" else {
            "max_output_tokens": 2, **body}
    return client.post(ROUTES[route], json=body)


@pytest.mark.parametrize(("field_name", "route", "param", "body"), LISTS,
                         ids=[f"{f}-{r}-{i}" for i, (f, r, _, _) in enumerate(LISTS)])
def test_each_list_serves_its_limit_and_refuses_one_past_it(client, field_name, route, param,
                                                            body) -> None:
    limit = getattr(LIMITS, field_name)
    response = post(client, route, body(limit))
    assert response.status_code == 200, response.text
    error = assert_openai_error(post(client, route, body(limit + 1)), 400,
                                flag_of(field_name), f"the limit is {limit}")
    assert error["param"] == param


def test_choice_strings_are_limited(make_fake_engine, open_client) -> None:
    engine = make_fake_engine(runner=MaskedRandomRunner(), structured=make_structured())
    client = open_client(engine, ServerConfig(limits=LIMITS))
    limit = LIMITS.max_choice_strings

    def body(amount: int) -> dict[str, Any]:
        choices = [f"c{i}" for i in range(amount)]
        return {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"choice": choices}}

    assert client.post("/v1/completions", json=body(limit)).status_code == 200
    assert_openai_error(client.post("/v1/completions", json=body(limit + 1)), 400,
                        "--max-choice-strings", f"the limit is {limit}")


def test_metadata_holds_openais_sixteen_pairs(client) -> None:
    def body(amount: int) -> dict[str, Any]:
        return {"input": "hi", "max_output_tokens": 2,
                "metadata": {f"k{i}": "v" for i in range(amount)}}

    assert client.post("/v1/responses", json=body(16)).status_code == 200
    assert_openai_error(client.post("/v1/responses", json=body(17)), 400, "metadata",
                        "17 metadata pairs", "the limit is 16")


def test_a_long_list_of_bad_items_is_one_problem_counted_first(client) -> None:
    body = {"prompt": "hi", "allowed_token_ids": ["x"] * LIMITS.max_allowed_token_ids}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400)
    assert error["message"] == "allowed_token_ids.0: Input should be a valid integer"
    body = {"prompt": "hi", "allowed_token_ids": ["x"] * 100}
    assert_openai_error(client.post("/v1/completions", json=body), 400,
                        "100 token ids", "--max-allowed-token-ids")


# ------------------------------------------------------------------ JSON values


def values_body(num_values: int) -> dict[str, Any]:
    """A chat body whose known fields hold `num_values` JSON values, and an unknown field
    of many more: messages (4 values: the list, the message, its two strings),
    max_tokens (1), chat_template_kwargs (the object, its list and its ints)."""
    return {"messages": [USER], "max_tokens": 2,
            "chat_template_kwargs": {"ids": [0] * (num_values - 7)}, "x": [[]] * 5000}


def test_json_values_are_counted_in_known_fields_only(client) -> None:
    limit = LIMITS.max_json_values
    response = client.post("/v1/chat/completions", json=values_body(limit))
    assert response.status_code == 200, response.text
    error = assert_openai_error(client.post("/v1/chat/completions", json=values_body(limit + 1)),
                                400, "--max-json-values", f"{limit + 1} JSON values",
                                f"the limit is {limit}")
    assert error["param"] == "chat_template_kwargs"
    # a string's commas and brackets are no values
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                    "user": "[{," * 1000})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("value", [
    [], [[]], {}, [1, 2, 3], {"a": [1, {"b": 2}], "c": {}}, ["a,b[", '\\"x,{', "q\\\\", "[]"],
    "s,[{", 5, None, {"a:": "b", "c": ["d", {}]},
])
def test_values_are_counted_exactly_on_the_bytes(value: Any) -> None:
    def count(v: Any) -> int:
        if isinstance(v, list):
            return 1 + sum(map(count, v))
        if isinstance(v, dict):
            return 1 + sum(map(count, v.values()))
        return 1

    for text in (json.dumps(value), json.dumps(value, separators=(",", ":"))):
        assert _num_values(text.encode()) == count(value), text


def test_only_the_models_fields_are_decoded() -> None:
    body = b'{"prompt": "hi", "x": [1, {"y": 2}], "max_tokens": 2, "z": "\\ud83d\\ude00"}'
    assert decode_fields(body, CompletionRequest, RequestLimits()) == {"prompt": "hi",
                                                                       "max_tokens": 2}


# ------------------------------------------------------------------ JSON errors


@pytest.mark.parametrize(("body", "needles", "param"), [
    (b'{"prompt": "hi", "temperature": NaN}', ("not valid JSON", "NaN", "temperature"),
     "temperature"),
    (b'{"prompt": "hi", "x": [1, -Infinity]}', ("-Infinity", "no JSON number"), None),
    (b'{"prompt": "hi", "max_tokens": 1e400}', ("max_tokens", "out of range"), "max_tokens"),
    (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", ("too long", "seed"), "seed"),
    (b'{"prompt": "hi", "x": "\\ud800"}', ("surrogate",), None),
    (b'{"prompt": "hi", "x": ["\\udc00 a"]}', ("surrogate",), None),
    (b'{"prompt": "hi", "x": "\xff"}', ("not valid JSON", "UTF-8"), None),
    (b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", ("nested too deeply",), None),
    (b'{"prompt": "hi"', ("not valid JSON", "ends before"), None),
    (b"[1, 2", ("not valid JSON",), None),
    (b'{"prompt": "hi"} x', ("not valid JSON", "trailing characters"), None),
    (b'[{"prompt": "hi"}]', ("must be a JSON object",), None),
])
def test_json_errors_are_400s_saying_why(client, body, needles, param) -> None:
    response = client.post("/v1/completions", content=body,
                           headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400, *needles)
    assert error["param"] == param


@pytest.mark.parametrize("body", [
    b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}',  # a UTF-8 byte order mark
    b'{"prompt": "hi", "max_tokens": 2, "x": "\\ud83d\\ude00 \xc3\xa9"}',
    b'{"prompt": "hi", "max_tokens": 2, "x": ' + b"[" * 200 + b"]" * 200 + b"}",
    b'{"prompt": "hi", "max_tokens": 2, "x": [' + b"[]," * 100_000 + b"{}]}",
])
def test_unknown_fields_of_any_shape_are_served(client, body) -> None:
    response = client.post("/v1/completions", content=body,
                           headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------ validation messages


BAD_ITEMS = [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content: content parts of type 'input_image' are not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]},
     "input: items of type 'item_reference' are not supported"),
    ({"input": [{"role": "tool", "content": "x"}]},
     "input.0.role: Input should be 'user', 'assistant', 'system' or 'developer'"),
    ({"input": [{"role": "user", "content": 5}]},
     "input.0.content: Input should be a valid string or an array"),
    ({"input": "hi", "tool_choice": 5},
     "tool_choice: Input should be 'none', 'auto' or 'required' or an object"),
]


@pytest.mark.parametrize(("body", "message"), BAD_ITEMS)
def test_responses_items_are_refused_in_the_bodys_terms(client, body, message) -> None:
    error = assert_openai_error(client.post("/v1/responses", json=body), 400)
    assert error["message"].startswith(message), error["message"]
    assert error["param"] == ("tool_choice" if "tool_choice" in body else "input")
    for internal in ("function-", "0x", "tagged-union", "constrained-", "[", "<"):
        assert internal not in error["message"], error["message"]


def test_a_validation_error_names_three_problems_and_counts_the_rest(client) -> None:
    body = {"prompt": "hi", "temperature": "x", "top_p": "x", "top_k": "x", "min_p": "x",
            "seed": "x"}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400)
    assert error["message"] == (
        "temperature: Input should be a valid number; top_p: Input should be a valid "
        "number; top_k: Input should be a valid integer; and 2 more problems")
    assert error["param"] == "temperature"


def test_a_validation_message_is_bounded_whatever_the_body(client) -> None:
    huge = "9" * 100_000
    body = {"prompt": "hi", "logit_bias": {huge: "x", "1" + huge: "y"}, "stop": [huge] * 3,
            "messages": huge}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400)
    assert len(error["message"]) <= 1024, len(error["message"])
    errors = [{"type": "value_error", "loc": ("f" * 10_000, i), "msg": "m" * 10_000}
              for i in range(10_000)]
    message = validation_error(errors).info.message
    assert len(message) <= 1024 and message.endswith("and 9997 more problems")


def test_union_branches_are_one_problem() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "hi", "stop": 5})
    error = validation_error(info.value.errors(), CompletionRequest)
    assert error.info.message == "stop: Input should be a valid string or an array"
    assert error.info.param == "stop"
