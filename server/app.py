"""The HTTP front end: OpenAI-compatible routes over an EngineClient.

Routes: POST /v1/completions (server/completions.py), POST /v1/chat/completions
(server/chat.py), JSON or SSE streams ending in `data: [DONE]` (server/streaming.py);
POST /v1/responses (server/responses_api.py), JSON or the Responses event stream;
GET /v1/models, /health, /metrics, /scheduler/state, OpenAI's Batch API (/v1/files,
/v1/batches: server/batch/, with a data directory), and the utility routes of
server/utility_routes.py (/tokenize, /detokenize, /version). Every error has OpenAI's shape
(server/errors.py); invalid requests (bad JSON and schema errors included) are 400, never
422. The middleware (server/middleware.py) checks the key and the body's size and arrival
before a route runs; the checks before any work are in server/admission.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.client import EngineClient
from engine.data_parallel import DataParallelEngine
from engine.outputs import EngineDeadError
from server.batch.api import MULTIPART_OVERHEAD_BYTES, BatchAPI
from server.batch.line_runner import Route
from server.chat import ChatCompletions
from server.completions import Completions
from server.config import ServerConfig
from server.errors import APIError, install_error_handlers, server_error
from server.lora import install_lora_routes
from server.middleware import (
    BodyLimitMiddleware,
    BodyTimeoutMiddleware,
    InternalErrorMiddleware,
    TenantAuthMiddleware,
)
from server.openapi import (
    generation_responses,
    install_openapi,
    json_request_body,
    responses_api_responses,
)
from server.requests import ChatCompletionRequest, CompletionRequest
from server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
)
from server.responses_api import Responses
from server.responses_request import ResponsesRequest
from server.serving import Serving
from server.tenants import TenantRegistry
from server.utility_routes import RequestIdMiddleware, install_utility_routes

AnyEngine = EngineClient | DataParallelEngine

# After the grace period the engine aborts what is left; handlers then need a moment to
# send their last chunk before uvicorn cuts the connections.
_ABORT_FLUSH_S = 2.0


def build_app(
    engine: AnyEngine, config: ServerConfig, tenants: TenantRegistry | None = None
) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan starts and stops the engine.

    `tenants` says who may ask for what (server/tenants.py); by default the one tenant
    of `config.api_key` (or, without a key, everyone)."""

    batch: BatchAPI | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if batch is not None:
            batch.start()
        yield
        if batch is not None:
            await batch.stop()
        engine.shutdown()

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    tenants = tenants if tenants is not None else TenantRegistry.single(config.api_key)
    _install_middleware(app, config, tenants)
    install_error_handlers(app)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest],
                    config.limits)
    serving = Serving(engine, config)
    routes = _install_openai_routes(app, serving)
    if config.batch.data_dir is not None:
        batch = BatchAPI(app, serving, routes, tenants, config.batch, engine)
    if config.runtime_lora_updating:
        install_lora_routes(app, serving)
    install_utility_routes(app, serving)
    _install_operations_routes(app, engine, config)
    return app


def _install_middleware(app: FastAPI, config: ServerConfig, tenants: TenantRegistry) -> None:
    """The middleware, innermost first: body size, body time, tenant, request id, then
    the internal-error catcher, the outermost of ours."""
    files_limit = config.batch.max_file_bytes + MULTIPART_OVERHEAD_BYTES
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.limits.max_body_bytes,
                       path_limits={"/v1/files": (files_limit, "max_batch_file_bytes")})
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=config.body_timeout_s)
    app.add_middleware(TenantAuthMiddleware, tenants=tenants,
                       metrics_key=config.metrics_api_key)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(InternalErrorMiddleware)  # the outermost of ours


def _install_openai_routes(app: FastAPI, serving: Serving) -> dict[str, Route]:
    """The generation routes (each through `serving.handle`, which releases the tenant's
    seat unless the engine took the request) and GET /v1/models; the generation routes'
    handlers by path (the batch lines run through them)."""
    completions_route = Completions(serving)
    chat_route = ChatCompletions(serving)
    responses_route = Responses(serving, chat_route)

    @app.post("/v1/completions", response_model=None,
              openapi_extra=json_request_body(CompletionRequest),
              responses=generation_responses(CompletionResponse, CompletionStreamResponse))
    async def completions(request: Request) -> Response:
        return await serving.handle(request, completions_route)

    @app.post("/v1/chat/completions", response_model=None,
              openapi_extra=json_request_body(ChatCompletionRequest),
              responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await serving.handle(request, chat_route)

    @app.post("/v1/responses", response_model=None,
              openapi_extra=json_request_body(ResponsesRequest),
              responses=responses_api_responses())
    async def responses(request: Request) -> Response:
        return await serving.handle(request, responses_route)

    @app.get("/v1/models")
    async def models() -> ModelList:
        max_model_len = serving.engine.info.max_model_len
        adapters = [ModelCard(id=name, root=path, parent=serving.model_name,
                              max_model_len=max_model_len)
                    for name, path in serving.loras.items()]
        return ModelList(data=[*(ModelCard(id=name, max_model_len=max_model_len)
                                 for name in serving.model_names), *adapters])

    return {"/v1/completions": completions_route, "/v1/chat/completions": chat_route,
            "/v1/responses": responses_route}


def _install_operations_routes(app: FastAPI, engine: AnyEngine, config: ServerConfig) -> None:
    """GET /health, /metrics and /scheduler/state."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """200 while the engine serves (with data parallelism: while any core does, and
        "degraded" naming the dead ones); 503 with the reason otherwise."""
        if not engine.is_alive:
            raise server_error(503, f"The engine is not serving: {engine.unavailable_reason()}.")
        dead = engine.dead_engines() if isinstance(engine, DataParallelEngine) else {}
        if dead:
            return {"status": "degraded", "dead_engines": {str(i): w for i, w in dead.items()}}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/scheduler/state")
    async def scheduler_state(request: Request, check: int = 0) -> dict[str, Any]:
        """The scheduler's state; with `check=1` also its integrity check's verdict. With
        a tenants file only an `admin` tenant may read it (it names every tenant's
        requests)."""
        tenant = getattr(request.state, "tenant", None)
        if tenant is not None and not tenant.is_admin:
            raise APIError(403, f"Tenant {tenant.name!r} may not read the scheduler state: "
                           "it needs `admin: true` in the tenants file.",
                           code="permission_denied")
        try:
            return await engine.snapshot(bool(check), timeout_s=config.snapshot_timeout_s)
        except EngineDeadError as exc:
            raise server_error(503, f"The engine is not serving: {exc}.") from exc


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with a shutdown (SIGTERM) that lets in-flight requests run for
    `grace_s`, then aborts what is left in the engine, so that every client still gets a
    well-formed end (finish_reason "abort", then `data: [DONE]` on a stream) before
    uvicorn closes the connections, `_ABORT_FLUSH_S` later."""

    def __init__(self, app: FastAPI, engine: AnyEngine, config: ServerConfig) -> None:
        super().__init__(uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            # NOTE: uvicorn's hint says int; it waits with asyncio, which takes a float
            timeout_graceful_shutdown=config.shutdown_grace_s + _ABORT_FLUSH_S,  # type: ignore[arg-type]
            limit_concurrency=config.limit_concurrency,
        ))
        self._engine = engine
        self._grace_s = config.shutdown_grace_s

    async def shutdown(self, sockets: Any = None) -> None:
        abort = asyncio.get_running_loop().call_later(self._grace_s, self._engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()
