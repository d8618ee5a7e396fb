"""The HTTP app's tools, reasoning, structured-output errors and small routes, over the
scripted runner (its script plays the model's output)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from server.config import ServerConfig
from tests.support.structured_helpers import MaskedRandomRunner, make_structured

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}


@pytest.fixture
def serve(make_fake_engine, open_client) -> Callable[..., TestClient]:
    def make(script: str = "Hello.", structured: bool = False, **config) -> TestClient:
        if structured:
            engine = make_fake_engine(runner=MaskedRandomRunner(), structured=make_structured(),
                                      start=False)
        else:
            engine = make_fake_engine(script=script, start=False)
        return open_client(engine, ServerConfig(**config))

    return make


def stream_deltas(client: TestClient, body: dict) -> list[dict]:
    deltas = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                deltas += [(c["delta"], c["finish_reason"]) for c in choices]
    return deltas


def test_auto_tool_call_is_parsed_whole_and_streamed(serve) -> None:
    client = serve(script="Sure. " + CALL, tool_call_parser="hermes")
    body = {**CHAT, "tools": TOOLS}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'} and call["id"]
    deltas = stream_deltas(client, body)
    content = "".join(d.get("content") or "" for d, _ in deltas)
    first, *rest = [c for d, _ in deltas for c in d.get("tool_calls") or ()]
    assert content == "Sure. " and deltas[-1][1] == "tool_calls"
    assert first["index"] == 0 and first["id"] and first["type"] == "function"
    assert first["function"] == {"name": "add", "arguments": ""}
    assert all(c["index"] == 0 and set(c) == {"index", "function"} for c in rest)
    assert "".join(c["function"]["arguments"] for c in rest) == call["function"]["arguments"]


def test_malformed_tool_call_output_is_plain_content(serve) -> None:
    text = "<tool_call>{oops</tool_call>"
    client = serve(script=text, tool_call_parser="hermes")
    choice = client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS}).json()
    assert choice["choices"][0]["message"]["content"] == text
    assert choice["choices"][0]["finish_reason"] == "stop"
    deltas = stream_deltas(client, {**CHAT, "tools": TOOLS})
    assert "".join(d.get("content") or "" for d, _ in deltas) == text


def test_tool_choice_errors_are_400(serve) -> None:
    client = serve()
    response = client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})
    assert response.status_code == 400 and "--tool-call-parser" in response.text
    named = {"type": "function", "function": {"name": "nope"}}
    response = client.post("/v1/chat/completions",
                           json={**CHAT, "tools": TOOLS, "tool_choice": named})
    assert response.status_code == 400 and "not in tools" in response.text
    response = client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"})
    assert response.status_code == 400


def test_reasoning_content_whole_and_streamed(serve) -> None:
    client = serve(script="<think>hmm</think>\nHi!", reasoning_parser="qwen3")
    message = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("hmm", "Hi!")
    deltas = stream_deltas(client, CHAT)
    assert "".join(d.get("reasoning_content") or "" for d, _ in deltas) == "hmm"
    assert "".join(d.get("content") or "" for d, _ in deltas) == "Hi!"


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
     "Invalid type"),
    ({"structured_outputs": {"regex": "("}}, "regex"),
    ({"structured_outputs": {"json": "[1, 2"}}, "not valid JSON"),
    ({"logit_bias": {"999999": 1}}, "out of range"),
    ({"logit_bias": {"abc": 1}}, "token ids"),
    ({"logit_bias": {"5": 101}}, "[-100, 100]"),
    ({"allowed_token_ids": [9999]}, "out of range"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "all"}, "prompt_logprobs"),
])
def test_bad_structured_and_sampling_fields_are_400(serve, body, needle) -> None:
    response = serve().post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
    assert response.status_code == 400 and needle in response.json()["error"]["message"]


def test_small_routes_aliases_and_request_id(serve) -> None:
    client = serve(served_model_name="fake-model", model_aliases=("other-name",))
    tokens = client.post("/tokenize", json={"prompt": "hé"}).json()
    assert tokens["tokens"] == list("hé".encode()) and tokens["count"] == 3
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {
        "prompt": "hé"}
    chat = client.post("/tokenize", json={"messages": CHAT["messages"]}).json()
    assert bytes(chat["tokens"]).decode() == "<user>hi\n<assistant>"
    assert client.post("/tokenize", json={}).status_code == 400
    assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert client.post("/detokenize", json={"tokens": [104.0, 105.0]}).json() == {"prompt": "hi"}
    assert client.post("/detokenize", json={"tokens": [True]}).status_code == 400
    assert client.get("/version").json()["version"]
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["fake-model", "other-name"]
    response = client.post("/v1/completions", json={"prompt": "x", "model": "other-name"},
                           headers={"X-Request-Id": "abc-123"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "abc-123"
    assert response.json()["model"] == "fake-model"
    assert client.get("/health").headers["x-request-id"]


def test_constrained_requests_over_http_validate(serve) -> None:
    import jsonschema

    client = serve(structured=True, tool_call_parser="hermes")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 99}, "s": {"enum": ["x", "y"]}}, "required": ["n", "s"],
              "additionalProperties": False}
    response = client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 60, "n": 3,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), schema)
    body = {**CHAT, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"


def test_constraints_are_400_when_the_engine_has_no_grammar_support(serve) -> None:
    response = serve().post("/v1/completions", json={
        "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert response.status_code == 400 and "not available" in response.text


def expected_prompt_logprobs(prompt: bytes) -> list:
    """What ScriptedRunner's prompt logprobs (and the byte tokenizer) give for `prompt`."""
    entries: list = [None]
    for i in range(1, len(prompt)):
        entry = {str(prompt[i]): {"logprob": -i / 10, "rank": 2,
                                  "decoded_token": chr(prompt[i])}}
        entry.setdefault(str(ord("~")), {"logprob": -0.01, "rank": 1, "decoded_token": "~"})
        entries.append(entry)
    return entries


def stream_choices(client: TestClient, route: str, body: dict) -> list[dict]:
    with client.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [c for line in r.iter_lines() if line.startswith("data: {")
                for c in json.loads(line[6:])["choices"]]


def test_prompt_logprobs_on_both_routes_every_choice_and_the_first_chunk(serve) -> None:
    client = serve()
    body = {"prompt": "Hi there", "max_tokens": 3, "n": 2, "prompt_logprobs": 1}
    expected = expected_prompt_logprobs(b"Hi there")
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["prompt_logprobs"] for c in choices] == [expected, expected]
    streamed = stream_choices(client, "/v1/completions", body)
    for index in (0, 1):
        mine = [c for c in streamed if c["index"] == index]
        assert mine[0]["prompt_logprobs"] == expected
        assert all("prompt_logprobs" not in c for c in mine[1:])
    plain = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain["choices"][0]

    rendered = b"<user>hi\n<assistant>"
    chat = {**CHAT, "max_tokens": 2, "prompt_logprobs": 0}
    [choice] = client.post("/v1/chat/completions", json=chat).json()["choices"]
    expected = [e and {k: v for k, v in e.items() if v["rank"] == 2}
                for e in expected_prompt_logprobs(rendered)]
    assert choice["prompt_logprobs"] == expected
    streamed = [c for c in stream_choices(client, "/v1/chat/completions", chat)
                if "prompt_logprobs" in c]
    assert [c["prompt_logprobs"] for c in streamed] == [expected]
