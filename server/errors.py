"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every error the HTTP server answers goes through `APIError`; the handlers installed by
`install_error_handlers` turn FastAPI's own errors into the same shape (a validation
error is a 400, never a 422). An unexpected exception becomes a 500 in
server/middleware.py, whose body names an error id, never the exception's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.responses import ErrorInfo, ErrorResponse


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


def validation_error(errors: Sequence[Any]) -> APIError:
    """One 400 naming every invalid field."""
    parts, param = [], None
    for error in errors:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
        if param is None and loc:
            param = loc[0]
    return APIError(400, "; ".join(parts) or "Invalid request.", param=param)


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

