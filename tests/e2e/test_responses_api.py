"""End to end on the default model: POST /v1/responses with the clients that call it, the
official `openai` client (`responses.create`, `responses.stream`, a json_schema format)
and the OpenAI Agents SDK, whose default model (OpenAIResponsesModel) answers a prompt,
streamed, and completes a function-tool round trip.

One server for the module: float32, greedy requests, --tool-call-parser hermes (the SDK
sends tool_choice "auto" once its tool has run); each request asks for a few tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import jsonschema
import openai
import pytest

from tests.e2e.conftest import ServerProcess, _require_default_model

pytestmark = pytest.mark.e2e

_T = TypeVar("_T")

MODEL = "smol"
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
          "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    _require_default_model()
    server = ServerProcess("--dtype", "float32", "--num-kv-blocks", "128",
                           "--served-model-name", MODEL, "--tool-call-parser", "hermes")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_create_and_stream_give_the_same_greedy_answer(client) -> None:
    kwargs = dict(model=MODEL, instructions="Answer briefly.", temperature=0,
                  input="Name a primary color.", max_output_tokens=8)
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.model == MODEL and whole.output_text
    assert whole.status in ("completed", "incomplete")
    assert 0 < whole.usage.output_tokens <= 8
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert streamed.output_text == whole.output_text
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_a_json_schema_format_validates(client) -> None:
    text = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA,
                       "strict": True}}
    response = client.responses.create(model=MODEL, input="A color and a count as JSON.",
                                       text=text, max_output_tokens=40, temperature=0)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_stored_responses_are_refused_clearly(client) -> None:
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_x")


# ------------------------------------------------------------------ the Agents SDK


def run_agent(server: ServerProcess, run: Callable[[Any], Awaitable[_T]]) -> _T:
    """`run(model)` on a fresh event loop, `model` the Agents SDK's default model
    (OpenAIResponsesModel) on a client of `server`, closed after the run."""
    from agents import OpenAIResponsesModel, set_tracing_disabled

    set_tracing_disabled(True)

    async def main() -> _T:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0) as client:
            return await run(OpenAIResponsesModel(model=MODEL, openai_client=client))

    return asyncio.run(main())


def test_the_agents_sdk_answers_a_prompt_streamed(server) -> None:
    from agents import Agent, ModelSettings, Runner

    async def run(model: Any) -> tuple[list[str], str]:
        agent = Agent(name="helper", instructions="Answer briefly.", model=model,
                      model_settings=ModelSettings(temperature=0, max_tokens=8))
        result = Runner.run_streamed(agent, "Name a primary color.")
        kinds = [event.type async for event in result.stream_events()]
        return kinds, str(result.final_output)

    kinds, answer = run_agent(server, run)
    assert "raw_response_event" in kinds and answer.strip()


def test_the_agents_sdk_completes_a_function_tool_round_trip(server) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool
    from agents.items import ToolCallItem, ToolCallOutputItem

    calls = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    async def run(model: Any) -> Any:
        # NOTE: a 135M model needs its first call forced (one call: the grammar then
        # ends the output); the SDK resets tool_choice once the tool has run
        agent = Agent(name="calculator", instructions="Use the add tool.", model=model,
                      tools=[add], model_settings=ModelSettings(
                          tool_choice="required", parallel_tool_calls=False, temperature=0,
                          max_tokens=40))
        return await Runner.run(agent, "What is 2 plus 3?", max_turns=3)

    result = run_agent(server, run)
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    assert calls == [(2, 3)]
    assert isinstance(result.final_output, str) and "5" in result.final_output
    assert len(result.raw_responses) == 2  # the call, then the answer to its output
