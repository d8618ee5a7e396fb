"""The OpenAPI schema of the generation routes, whose bodies are parsed by hand
(server/admission.py): the request models as documented bodies (bounded by this server's
request limits), the SSE chunk models and the error answers."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pydantic
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from server.limits import RequestLimits
from server.responses import ChatCompletionChunk, CompletionStreamResponse, ErrorResponse

# (request property, limit field, the JSON Schema keyword by the JSON type it bounds): the
# budgets of server/limits.py a schema can state (a stop list's items are strings too).
_LIMITED_PROPERTIES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("n", "max_n", {"integer": "maximum"}),
    ("logprobs", "max_logprobs", {"integer": "maximum"}),
    ("top_logprobs", "max_logprobs", {"integer": "maximum"}),
    ("prompt_logprobs", "max_logprobs", {"integer": "maximum"}),
    ("stop", "max_stop_strings", {"array": "maxItems"}),
    ("stop", "max_stop_string_chars", {"string": "maxLength"}),
    ("logit_bias", "max_logit_bias", {"object": "maxProperties"}),
    ("tools", "max_tools", {"array": "maxItems"}),
    ("messages", "max_messages", {"array": "maxItems"}),
    ("input", "max_messages", {"array": "maxItems"}),
    ("stop_token_ids", "max_stop_token_ids", {"array": "maxItems"}),
    ("allowed_token_ids", "max_allowed_token_ids", {"array": "maxItems"}),
)


def json_request_body(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON body of `model`."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def generation_responses(
    response: type[pydantic.BaseModel], chunk: type[pydantic.BaseModel]
) -> dict[int | str, dict[str, Any]]:
    """The answers of a generation route: the response, or an SSE stream of `chunk` objects
    ending in `data: [DONE]`, or an error in OpenAI's shape."""
    # One server-sent event: a chunk, an error (then the end), or the final [DONE].
    event_data = {"anyOf": [
        {"type": "string", "const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"$ref": f"#/components/schemas/{chunk.__name__}"},
            {"$ref": "#/components/schemas/ErrorResponse"},
        ]}},
    ]}
    event = {"type": "object", "required": ["data"], "properties": {"data": event_data}}
    stream = {"schema": event}
    return {
        200: {
            "model": response,
            "description": "The completion, or with `stream` a text/event-stream of chunks.",
            "content": {"text/event-stream": stream},
        },
        **error_responses(),
    }


def responses_api_responses() -> dict[int | str, dict[str, Any]]:
    """The answers of POST /v1/responses: a response object, or the Responses event
    stream (`event:` and `data:` lines, server/responses_events.py), or an error."""
    event = {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json"},
    }}
    return {
        200: {
            "description": "The response object, or with `stream` a text/event-stream of "
            "Responses events ending in response.completed.",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": event}},
        },
        **error_responses(),
    }


def error_responses() -> dict[int | str, dict[str, Any]]:
    """A generation route's errors, in OpenAI's shape."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status, why in ((400, "Invalid request"), (401, "Missing or wrong API key"),
                        (403, "A priority more urgent than the tenant may ask for"),
                        (404, "Unknown model"), (408, "The body did not arrive in time"),
                        (413, "Request body too large"),
                        (429, "Over the tenant's in-flight or token-rate limit"),
                        (500, "A step of the engine failed"),
                        (503, "Engine not running, or too many requests waiting"),
                        (504, "The request's deadline passed before it was computed")):
        responses[status] = {"model": ErrorResponse, "description": why}
    return responses


def install_openapi(
    app: FastAPI, request_models: Sequence[type[pydantic.BaseModel]], limits: RequestLimits
) -> None:
    """Add the request models (and the chunk models) to the schema's components, their
    fields bounded by `limits` as the server checks them."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models: list[tuple[type[pydantic.BaseModel], JsonSchemaMode]] = [
                *((m, "validation") for m in request_models),
                (CompletionStreamResponse, "serialization"),
                (ChatCompletionChunk, "serialization"),
            ]
            _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
            for model in request_models:
                _bound(components[model.__name__]["properties"], limits)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bound(properties: dict[str, Any], limits: RequestLimits) -> None:
    """Write each budget of `limits` into the schema of the property it bounds."""
    for name, field_name, keywords in _LIMITED_PROPERTIES:
        if name in properties:
            # NOTE: a copy: pydantic may hand out a WithJsonSchema's own dict.
            properties[name] = copy.deepcopy(properties[name])
            _set_keyword(properties[name], keywords, getattr(limits, field_name))


def _set_keyword(schema: dict[str, Any], keywords: dict[str, str], value: int) -> None:
    """Set the keyword of `schema`'s JSON type (in each anyOf branch, and an array's
    items) to `value`."""
    keyword = keywords.get(schema.get("type", ""))
    if keyword is not None:
        schema[keyword] = value
    for branch in schema.get("anyOf", ()):
        _set_keyword(branch, keywords, value)
    if isinstance(schema.get("items"), dict):
        _set_keyword(schema["items"], keywords, value)
