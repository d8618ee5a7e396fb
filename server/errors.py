"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every error the HTTP server answers goes through `APIError`; the handlers installed by
`install_error_handlers` turn FastAPI's own errors into the same shape (a validation
error is a 400, never a 422). An unexpected exception becomes a 500 in
server/middleware.py, whose body names an error id, never the exception's text.
"""

from __future__ import annotations

import collections.abc
import re
import types
import typing
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.responses import ErrorInfo, ErrorResponse

MAX_PROBLEMS_SHOWN = 3  # a validation error's message names these and counts the rest
_MAX_PROBLEM_CHARS = 300
_MAX_ERRORS_READ = 64  # the rest are only counted
_MAX_PATH_PART_CHARS = 64
_SHOULD = "Input should be "
# pydantic's errors that refuse a value's JSON type (or its constant)
_WRONG_TYPE = frozenset({"string_type", "int_type", "float_type", "bool_type", "list_type",
                         "dict_type", "model_type", "model_attributes_type", "none_required",
                         "literal_error"})
_FIELD_LIKE_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "any"})


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.info).model_dump()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


def server_error(status_code: int, message: str, **kwargs: Any) -> APIError:
    return APIError(status_code, message, type="server_error", **kwargs)


def validation_error(errors: Sequence[Any], model: Any = None) -> APIError:
    """One 400 naming the first few of pydantic's `errors` (of a body of `model`, when
    given) and how many more there are, each as the field's path in the body and what it
    should be; `param` is the first one's field. Never pydantic's internals (the branches of
    a union it tried, validator names), and bounded (about 1 KB) whatever the body."""
    problems = _problems(errors[:_MAX_ERRORS_READ], model)
    shown = [f"{_dotted(path)}: {text}" if path else text
             for path, text in problems[:MAX_PROBLEMS_SHOWN]]
    message = "; ".join(_clip(s, _MAX_PROBLEM_CHARS) for s in shown) or "Invalid request."
    rest = len(problems) - len(shown) + max(0, len(errors) - _MAX_ERRORS_READ)
    if rest:
        message += f"; and {rest} more problem{'s' if rest > 1 else ''}"
    param = next((str(path[0]) for path, _ in problems[:1] if path), None)
    return APIError(400, message, param=param)


def _problems(errors: Sequence[Any], model: Any) -> list[tuple[list[str | int], str]]:
    """(path, text) of each problem in order, a path's texts joined: a union's branches
    each fail with their own error (`stop` 5: not a string, not a list), and a branch that
    only refused the value's type is left out where another one got further."""
    found = [(user_path(model, error.get("loc", ())), str(error.get("type", "")),
              _text(error)) for error in errors]
    kept: dict[tuple[str | int, ...], list[str]] = {}
    for path, kind, text in found:
        if kind in _WRONG_TYPE and any(
            other[:len(path)] == path and (len(other) > len(path) or other_kind not in _WRONG_TYPE)
            for other, other_kind, _ in found
        ):
            continue
        texts = kept.setdefault(tuple(path), [])
        if text not in texts:
            texts.append(text)
    return [(list(path), _either(texts)) for path, texts in kept.items()]


def _either(texts: list[str]) -> str:
    """"Input should be a valid string or an array" from the two."""
    if len(texts) > 1 and all(t.startswith(_SHOULD) for t in texts):
        return _SHOULD + " or ".join(t.removeprefix(_SHOULD) for t in texts)
    return " or ".join(texts)


def _text(error: Any) -> str:
    kind = error.get("type")
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return _SHOULD + "an object"  # pydantic names the model's class
    if kind == "list_type":
        return _SHOULD + "an array"
    return str(error.get("msg", "")).removeprefix("Value error, ")


def _dotted(path: list[str | int]) -> str:
    return ".".join(_clip(str(part), _MAX_PATH_PART_CHARS) for part in path)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def user_path(model: Any, loc: Sequence[Any]) -> list[str | int]:
    """pydantic's `loc` of an error in a body of `model` as the path a client wrote (fields,
    keys and indices), without the union branches pydantic names in it ("str",
    "list[TextPart]", a tagged union's tag, "function-after[...]"). Without a model (or
    past what the model declares), the parts that look like fields and indices."""
    path: list[str | int] = []
    node = model
    for i, part in enumerate(loc):
        node = _unwrap(node)
        members = _union_members(node)
        if members is not None:  # `part` names the branch; the next part tells which
            node = _branch(members, part, loc[i + 1] if i + 1 < len(loc) else None)
            continue
        if isinstance(part, int):
            path.append(part)
            node = _item_type(node)
        elif _is_model(node):
            path.append(part)
            field = _field(node, part)
            node = field.annotation if field is not None else None
        elif typing.get_origin(node) is dict:
            path.append(part)
            node = typing.get_args(node)[1]
        else:  # unknown: skip what looks like a type or validator, not a field
            node = None
            if _FIELD_LIKE_RE.fullmatch(part) and part not in _TYPE_NAMES and (
                    i > 0 or part != "body"):  # FastAPI's own errors start with "body"
                path.append(part)
    return path


def _unwrap(node: Any) -> Any:
    """Annotated[X, ...] and X | None as X."""
    while True:
        if typing.get_origin(node) is typing.Annotated:
            node = typing.get_args(node)[0]
            continue
        members = _non_none(node)
        if members is not None and len(members) == 1:
            node = members[0]
            continue
        return node


def _non_none(node: Any) -> list[Any] | None:
    if typing.get_origin(node) not in (typing.Union, types.UnionType):
        return None
    return [m for m in typing.get_args(node) if m is not type(None)]


def _union_members(node: Any) -> list[Any] | None:
    members = _non_none(node)
    return [_unwrap(m) for m in members] if members is not None and len(members) > 1 else None


def _branch(members: list[Any], tag: Any, after: Any) -> Any:
    """The member of a union that pydantic's `tag` names (a model's class name or a tagged
    union's tag; else the one that `after`, the next part of the path, fits)."""
    for member in members:
        if _is_model(member) and (member.__name__ == tag or any(
            typing.get_origin(f.annotation) is typing.Literal
            and tag in typing.get_args(f.annotation) for f in member.model_fields.values()
        )):
            return member
    for member in members:
        if isinstance(after, int) and _item_type(member) is not None:
            return member
        if isinstance(after, str) and _is_model(member) and _field(member, after):
            return member
    return None


def _is_model(node: Any) -> bool:
    return isinstance(node, type) and issubclass(node, BaseModel)


def _field(model: type[BaseModel], key: Any) -> FieldInfo | None:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field
    return None


def _item_type(node: Any) -> Any:
    if typing.get_origin(node) in (list, tuple, set, frozenset, collections.abc.Sequence):
        return typing.get_args(node)[0]
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=error_type).response()

