"""The FastAPI app of `primerl inference`: its routes, middlewares, error handlers and OpenAPI schema.

Routes (docs/inference.md): `GET /health`, `GET /v1/models`, the completion routes (primerl.inference.completions)
and the bearer-token admin routes (primerl.inference.admin). Middlewares, outermost first: `AdminGate` answers
`/admin/*` without the token with 401 before the body is read; `AdmissionLimit` refuses a completion beyond
`max_concurrent_requests` with 429 at once. Every error, the framework's own included, leaves as an OpenAI-style body
(`{"error": {"message", "type", "param", "code"}}`): bad input is a 4xx, never a 500, and the OpenAPI schema says so.
The app owns the engine's lifetime: it starts it (and the configured weight receiver) on startup and stops it on
shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from primerl.config.inference import InferenceConfig
from primerl.inference.admin import Admin
from primerl.inference.completions import Completions
from primerl.inference.engines.base import Engine
from primerl.inference.engines.factory import describe_engine
from primerl.inference.protocol import (
    MAX_NAME_CHARS,
    AdminState,
    APIError,
    ChatCompletionRequest,
    ErrorBody,
    GenerateRequest,
    Health,
    ModelCard,
    ModelList,
    UpdateWeightsRequest,
    printable,
)

log = logging.getLogger("primerl.inference")


def create_app(engine: Engine, cfg: InferenceConfig) -> FastAPI:
    """The HTTP app over `engine`. The app owns the engine's lifetime: it starts it on startup and stops it on
    shutdown. `cfg.admin_token` must be set (`resolve_admin_token`)."""
    completions, admin = Completions(engine, cfg), Admin(engine, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log.info("serving %s on http://%s:%d", describe_engine(engine), cfg.host, cfg.port)
        await admin.receivers.start()
        try:
            yield
        finally:
            await engine.stop()
            log.info("engine stopped")

    app = FastAPI(title="primerl inference", lifespan=lifespan, docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    # outermost first: the token is checked before anything reads the body, then completions are admitted
    app.add_middleware(AdmissionLimit, limit=cfg.max_concurrent_requests, paths=COMPLETION_ROUTES)
    app.add_middleware(AdminGate, admin=admin)

    @app.get("/health", response_model=Health, responses=_errors(503))
    async def health() -> JSONResponse:
        ok = engine.healthy()
        body = Health(
            status="ok" if ok else "unavailable",
            model=completions.served_name,
            policy_version=engine.policy_version,
            paused=admin.paused,
        )
        return JSONResponse(body.model_dump(mode="json"), status_code=200 if ok else 503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(
            id=completions.served_name,
            created=completions.created,
            max_model_len=engine.max_model_len,
            policy_version=engine.policy_version,
        )
        return ModelList(data=[card])

    @app.post("/v1/chat/completions", responses=_errors(400, 404, 429, 503))
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        return await completions.chat(req)

    @app.post("/inference/v1/generate", responses=_errors(400, 404, 429, 503))
    async def generate(req: GenerateRequest) -> Any:
        return await completions.generate(req)

    @app.post("/admin/update_weights", responses=_errors(400, 401))
    async def update_weights(req: UpdateWeightsRequest) -> AdminState:
        return await admin.update_weights(req)

    @app.post("/admin/pause", responses=_errors(401))
    async def pause() -> AdminState:
        return await admin.set_paused(True)

    @app.post("/admin/resume", responses=_errors(401))
    async def resume() -> AdminState:
        return await admin.set_paused(False)

    _document_errors(app)
    return app


COMPLETION_ROUTES = ("/v1/chat/completions", "/inference/v1/generate")
_ERROR_WHEN = {
    400: "invalid request: the message names the field",
    401: "missing or wrong admin token",
    404: "unknown model",
    429: "too many requests in flight (`max_concurrent_requests`); retry after `Retry-After` seconds",
    503: "the engine is not serving (starting, stopping, failed)",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the errors a route answers with, all in the `ErrorBody` shape."""
    return {status: {"model": ErrorBody, "description": _ERROR_WHEN[status]} for status in statuses}


def _document_errors(app: FastAPI) -> None:
    """Make the OpenAPI schema say what the routes answer: validation errors are 400 (not FastAPI's 422), every
    route may answer 405 (with `Allow`) to another method and 500 with the error body."""
    generate_schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate_schema()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    responses = operation["responses"]
                    responses.pop("422", None)
                    content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
                    responses["405"] = {"description": "method not allowed; `Allow` names the allowed ones",
                                        "content": content}
                    responses["500"] = {"description": "internal error", "content": content}
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class AdminGate:
    """ASGI middleware: `/admin/*` without the admin token is a 401 before the body is read or validated."""

    def __init__(self, app: Any, admin: Admin) -> None:
        self.app, self.admin = app, admin

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/admin/"):
            headers = dict(scope["headers"])
            error = self.admin.auth_error(headers.get(b"authorization", b"").decode("latin-1"))
            if error is not None:
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AdmissionLimit:
    """ASGI middleware: at most `limit` requests to `paths` in flight (a streaming response counts until its last
    byte); one more is refused at once with 429 and `Retry-After`, so a flood queues nowhere in the server."""

    def __init__(self, app: Any, limit: int, paths: Sequence[str]) -> None:
        self.app, self.limit, self.paths = app, limit, set(paths)
        self.in_flight = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = APIError(
                429,
                f"{self.in_flight} requests in flight, this server's limit (max_concurrent_requests); retry later",
                type="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
            await _error_response(error)(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _error_response(error: APIError) -> JSONResponse:
    """The response for `error`, logged on one line (what the client sent appears escaped and bounded)."""
    log.info("%d %s", error.status, printable(error.message, 500))
    headers = {**(error.headers or {}), **({"WWW-Authenticate": "Bearer"} if error.status == 401 else {})}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`."""
    respond = _error_response

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return respond(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        return respond(_validation_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        where = printable(f"{request.method} {request.url.path}", MAX_NAME_CHARS)
        return respond(APIError(error.status_code, f"{where}: {error.detail}", type=kind, headers=error.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return respond(APIError(500, f"internal error: {error!r}", type="server_error"))


def _validation_error(error: RequestValidationError) -> APIError:
    """The first problem of a request that failed validation, naming the offending field."""
    first = error.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    if param is None:
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)")
    message = f"{param}: {first['msg'].removeprefix('Value error, ')}"
    more = len(error.errors()) - 1
    return APIError(400, message + (f" (and {more} more problem{'s' * (more > 1)})" if more else ""), param=param)
