"""End to end on the default model: structured outputs, tool calls with the official
`openai` client, reasoning split, and the small OpenAI/vLLM routes and fields.

One server for the module: priority scheduling on a small KV pool (24 blocks of 8), so
that the random-schema runs (mixed priorities, 16 in flight) are a preemption storm,
with --tool-call-parser hermes, --reasoning-parser qwen3, a --chat-template file and two
model aliases.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model

pytestmark = pytest.mark.e2e

NUM_SCHEMAS = 50
CONCURRENCY = 16
MODEL, ALIAS = "smol", "smol-alias"
TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% if shout %} (SHOUT){% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    _require_default_model()
    template = Path(tmp_path_factory.mktemp("template")) / "chat.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess(
        "--scheduling-policy", "priority", "--block-size", "8", "--num-kv-blocks", "24",
        "--max-num-seqs", "16",
        "--max-num-batched-tokens", "256", "--served-model-name", MODEL, ALIAS,
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--chat-template", str(template),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def post(server: ServerProcess, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kw)


def scheduler_state(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/scheduler/state?check=1").json()


# ------------------------------------------------------------------ random schemas


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-2 properties: strings with a pattern or a length limit,
    bounded integers, booleans, enums, short arrays and (once) a nested object. Values
    are kept short: on two shared cores every output token counts."""
    kinds = ["pattern", "string", "integer", "boolean", "enum", "array"]
    if depth == 0:
        kinds.append("object")
    properties = {}
    for name in "ab"[: rng.randint(1, 2 if depth == 0 else 1)]:
        kind = rng.choice(kinds)
        if kind == "pattern":
            schema = {"type": "string",
                      "pattern": rng.choice(["^[a-z]{1,4}$", "^[A-Z][0-9]{2}$", "^(yes|no)$"])}
        elif kind == "string":
            schema = {"type": "string", "maxLength": rng.randint(1, 4)}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            schema = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 99)}
        elif kind == "boolean":
            schema = {"type": "boolean"}
        elif kind == "enum":
            schema = {"enum": rng.sample(["red", "green", "blue", 1, 2, None], 3)}
        elif kind == "array":
            schema = {"type": "array", "maxItems": rng.randint(1, 2),
                      "items": rng.choice([{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"enum": ["x", "y"]}])}
        else:
            schema = random_schema(rng, depth + 1)
        properties[name] = schema
    names = list(properties)
    return {"type": "object", "properties": properties,
            "required": rng.sample(names, rng.randint(1, len(names))),
            "additionalProperties": False}


SCHEMAS = [random_schema(random.Random(seed)) for seed in range(NUM_SCHEMAS)]


def _constrained(server: ServerProcess, schema: dict, temperature: float, n: int = 1,
                 priority: int = 0) -> list[str]:
    response = post(server, "/v1/completions", {
        "model": MODEL, "prompt": "A JSON object:", "max_tokens": 80, "n": n,
        "temperature": temperature, "priority": priority, "seed": 1,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": schema}},
    })
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["text"] for c in choices]


def test_random_schemas_validate_at_both_temperatures_under_preemption(server) -> None:
    before = scheduler_state(server)["num_preemptions_total"]
    jobs = [(schema, temperature, i % 3) for i, schema in enumerate(SCHEMAS)
            for temperature in (0.0, 1.0)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        texts = list(pool.map(lambda job: _constrained(server, *job[:2], priority=job[2]),
                              jobs))
    for (schema, _, _), outputs in zip(jobs, texts, strict=True):
        jsonschema.validate(json.loads(outputs[0]), schema)
    state = scheduler_state(server)
    assert state["num_preemptions_total"] > before  # the small pool preempted
    assert state["integrity"] == "ok" and state["kv_cache"]["usage"] == 0


def test_n4_choices_each_validate(server) -> None:
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda s: (s, _constrained(server, s, 1.0, n=4)), SCHEMAS[:2]))
    for schema, outputs in results:
        assert len(outputs) == 4
        for text in outputs:
            jsonschema.validate(json.loads(text), schema)


def test_choice_and_regex_always_match(server) -> None:
    def run(job: tuple[str, object, float]) -> tuple[str, object, str]:
        kind, value, temperature = job
        response = post(server, "/v1/completions", {
            "prompt": "Answer:", "max_tokens": 24, "temperature": temperature, "n": 2,
            "structured_outputs": {kind: value},
        })
        assert response.status_code == 200, response.text
        return kind, value, [c["text"] for c in response.json()["choices"]]

    choices = ["alpha", "beta", "gamma delta", "ε"]
    regex = r"[0-9]{3}-[a-z]{2,4}"
    jobs = [(k, v, t) for k, v in (("choice", choices), ("regex", regex)) for t in (0, 1)] * 2
    with ThreadPoolExecutor(8) as pool:
        for kind, value, texts in pool.map(run, jobs):
            for text in texts:
                assert text in value if kind == "choice" else re.fullmatch(value, text), text


def test_json_object_and_lark_grammar_and_chat_json_schema(server) -> None:
    response = post(server, "/v1/completions", {
        "prompt": "x =", "max_tokens": 16, "temperature": 0,
        "structured_outputs": {"grammar": 'start: "x" NUMBER\nNUMBER: /[1-9][0-9]?/'}})
    assert re.fullmatch(r"x[1-9][0-9]?", response.json()["choices"][0]["text"])
    schema = SCHEMAS[0]
    response = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 80,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    })
    jsonschema.validate(json.loads(response.json()["choices"][0]["message"]["content"]), schema)


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "nope"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"schema": {"$ref": "#/missing"}}}}, "missing"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    # what only the compile for the model's tokenizer rejects, and the budgets
    ({"structured_outputs": {"grammar": "start: <|nope|>"}}, "<|nope|>"),
    ({"structured_outputs": {"grammar": "start: <[999999]>"}}, "999999"),
    ({"structured_outputs": {"json": '{"items":' * 50_000 + "{}" + "}" * 50_000}},
     "--max-grammar-bytes"),
    ({"structured_outputs": {"json": '{"items":' * 65 + "{}" + "}" * 65}},
     "--max-grammar-depth"),
])
def test_uncompilable_constraints_are_400_saying_why(server, body, needle) -> None:
    response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_costly_grammar_fails_alone_and_never_with_stop(server) -> None:
    costly = {"prompt": "aaaa", "max_tokens": 64,
              "structured_outputs": {"regex": "(a{1000}){1000}"}}
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(post, server, "/v1/completions", costly)
        other = _constrained(server, SCHEMAS[0], 0.0)
        response = hostile.result()
    jsonschema.validate(json.loads(other[0]), SCHEMAS[0])
    # a 400 either way: its compile and first mask outlived the time limit, or its lexer
    # gives up on a later mask (an error, not finish_reason "stop")
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "--grammar-timeout-s" in message or "grammar" in message
    assert scheduler_state(server)["integrity"] == "ok"


# ------------------------------------------------------------------ tools


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999},
            "b": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["a", "b"]}}},
]
ARGUMENTS = {"get_weather": {"city", "unit"}, "add": {"a", "b"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? And 2 + 3?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert set(json.loads(call.function.arguments)) == ARGUMENTS[call.function.name]


def test_openai_client_required_and_named_tool_calls_parse(client) -> None:
    def create(**kw):
        return client.chat.completions.create(messages=MESSAGES, tools=TOOLS, seed=1, **kw)

    jobs = [
        dict(model=MODEL, tool_choice="required", n=2, temperature=1.0, max_tokens=80,
             parallel_tool_calls=False),
        dict(model=MODEL, tool_choice="required", temperature=0.0, max_tokens=150),
        dict(model=ALIAS, tool_choice={"type": "function", "function": {"name": "add"}},
             n=2, temperature=1.0, max_tokens=80),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        single, parallel, named = pool.map(lambda kw: create(**kw), jobs)
    for choice in [*single.choices, *parallel.choices, *named.choices]:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)
    assert all([c.function.name for c in choice.message.tool_calls] == ["add"]
               for choice in named.choices)


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_call(client) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=80, temperature=0, parallel_tool_calls=False)

    def streamed() -> tuple[list[dict], str | None]:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            finish = chunk.choices[0].finish_reason or finish
            for piece in chunk.choices[0].delta.tool_calls or ():
                if piece.index not in calls:  # OpenAI's first delta of a call
                    assert piece.id and piece.type == "function" and piece.function.name
                    assert piece.function.arguments == ""
                entry = calls.setdefault(piece.index, {"name": "", "arguments": "",
                                                       "num_pieces": 0})
                entry["name"] += piece.function.name or ""
                entry["arguments"] += piece.function.arguments or ""
                entry["num_pieces"] += 1
        return list(calls.values()), finish

    with ThreadPoolExecutor(2) as pool:
        full_future = pool.submit(lambda: client.chat.completions.create(**kwargs))
        calls, finish = streamed()
        full = full_future.result().choices[0].message.tool_calls
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in full]
    assert all(c["num_pieces"] > 2 for c in calls)  # the arguments came in fragments


def test_tool_choice_auto_gives_plain_content(client) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
        tool_choice="auto", max_tokens=6, temperature=0)
    message = response.choices[0].message
    assert message.content and not message.tool_calls


# ------------------------------------------------------------------ reasoning


def test_reasoning_content_split_complete_and_streamed(server, client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}],
            "max_tokens": 30, "temperature": 0,
            "structured_outputs": {"regex": "<think>[a-z ]{3,12}</think>[A-Za-z ]{2,8}"}}
    message = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["reasoning_content"] and "<think>" not in message["content"]
    reasoning, content = "", ""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    assert (reasoning, content) == (message["reasoning_content"], message["content"])


# ------------------------------------------------------------------ small routes and fields


def test_tokenize_detokenize_version_models(server) -> None:
    tokens = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    text = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("Hello world")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    plain = post(server, "/tokenize", chat).json()["count"]
    loud = post(server, "/tokenize", {**chat, "chat_template_kwargs": {"shout": True}}).json()
    assert loud["count"] > plain  # chat_template_kwargs reach the --chat-template file
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, ALIAS] and models[0]["max_model_len"] > 0


def test_request_id_header_is_passed_through(server) -> None:
    response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                    headers={"X-Request-Id": "my-trace-42"})
    assert response.headers["x-request-id"] == "my-trace-42"
    assert "my-trace-42" in server.log_tail()
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).headers[
        "x-request-id"]


def test_sampling_fields(server, default_tokenizer) -> None:
    target = default_tokenizer.encode(" banana", add_special_tokens=False)[0]
    body = {"prompt": "My favourite fruit is", "max_tokens": 3, "temperature": 0}
    biased = post(server, "/v1/completions", {**body, "logit_bias": {str(target): 100}})
    assert biased.json()["choices"][0]["text"].startswith(" banana")
    allowed = post(server, "/v1/completions", {**body, "allowed_token_ids": [target]})
    assert allowed.json()["choices"][0]["text"] == " banana" * 3
    stop = {**body, "max_tokens": 20, "stop": ["banana"], "allowed_token_ids": [target]}
    kept = post(server, "/v1/completions", {**stop, "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"] == " banana"
    assert post(server, "/v1/completions", stop).json()["choices"][0]["text"] == " "
    eos = default_tokenizer.convert_tokens_to_ids("<|im_end|>")
    special = {**body, "max_tokens": 1, "logit_bias": {str(eos): 100}, "ignore_eos": True}
    shown = post(server, "/v1/completions", {**special, "skip_special_tokens": False})
    assert shown.json()["choices"][0]["text"] == "<|im_end|>"
    assert post(server, "/v1/completions", special).json()["choices"][0]["text"] == ""
    bad = post(server, "/v1/completions", {**body, "allowed_token_ids": [10**8]})
    assert bad.status_code == 400
