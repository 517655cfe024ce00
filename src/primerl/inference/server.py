"""`primerl inference`: the OpenAI-compatible HTTP server over a generation engine.

Routes (see docs/inference.md): `GET /health`, `GET /v1/models`, `POST /v1/chat/completions` (OpenAI shape, SSE
streaming), `POST /inference/v1/generate` (vLLM's token route, as `renderers.client.generate` calls it), and the
bearer-token admin routes `POST /admin/update_weights`, `/admin/pause`, `/admin/resume`.

The server turns requests into engine calls — chat template, seeds, context-length checks — and engine events into
responses — text, stop-string cuts, tool calls, logprobs. Every choice carries `policy_versions` (the weight versions
that sampled it) and every completion response an `X-Policy-Version` header (the engine's version when the headers
went out). Bad input is a 4xx with an OpenAI-style error body; nothing a client sends can take the server down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from primerl.config import config_from_argv
from primerl.config.inference import InferenceConfig
from primerl.cpu import keep_freed_memory
from primerl.inference.chat import CompletionText, cut_at_stop, render_chat, split_tool_calls
from primerl.inference.engines.base import Engine, Event, Finish, SamplingParams, TokenEvent
from primerl.inference.protocol import (
    MAX_NAME_CHARS,
    AdminState,
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    ErrorBody,
    FunctionCallDelta,
    GenerateChoice,
    GenerateLogprobs,
    GenerateRequest,
    GenerateResponse,
    Health,
    ModelCard,
    ModelList,
    PromptLogprob,
    RequestModel,
    SamplingFields,
    TokenIdLogprob,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    UpdateWeightsRequest,
    Usage,
    context_length_error,
    printable,
)
from primerl.transport import weights as weight_snapshots

log = logging.getLogger("primerl.inference")

POLICY_VERSION_HEADER = "X-Policy-Version"
MAX_LOGGED_FIELDS = 20  # ignored request fields named in the log line, at most
SHUTDOWN_GRACE_S = 10  # on SIGTERM/SIGINT, requests in flight get this long to finish before they are aborted


# ---------------------------------------------------------------------------------------------------------------------
# Engine side: one sample = one engine request


@dataclass
class Sample:
    """What one engine request produced so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # the policy version that sampled each token
    finish: Finish | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.token_ids.append(event.token_id)
            self.logprobs.append(event.logprob)
            self.token_versions.append(event.policy_version)
        else:
            self.finish = event

    def policy_versions(self) -> list[int]:
        """Distinct versions among the sampled tokens; the version at the finish when no token was sampled."""
        if self.token_versions or self.finish is None:
            return sorted(set(self.token_versions))
        return [self.finish.policy_versions[1]]


async def _collect(stream: AsyncIterator[Event]) -> Sample:
    sample = Sample()
    async for event in stream:
        sample.add(event)
    return sample


async def _merge(streams: list[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """Events of several engine streams as they arrive, tagged with the stream's index. Leaving early (client gone,
    server stopping) closes every stream, which aborts its engine request."""
    queue: asyncio.Queue[tuple[int, Event | BaseException]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Event]) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((index, error))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, Finish):
                open_streams -= 1
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------------------------------------------
# The server


class InferenceServer:
    """Request handling over one engine: validation, engine calls, response assembly."""

    def __init__(self, engine: Engine, cfg: InferenceConfig) -> None:
        if cfg.admin_token is None:
            raise ValueError(
                "InferenceConfig.admin_token must be set before the app is built (see resolve_admin_token)"
            )
        self.engine = engine
        self.cfg = cfg
        self.served_name = cfg.served_model_name or cfg.model.name
        self.admin_token = cfg.admin_token.get_secret_value()
        self.created = int(time.time())
        self.paused = False
        self._admin_lock = asyncio.Lock()
        self._loaded_snapshot: tuple | None = None  # what update_weights loaded last (see _snapshot_identity)

    # ---- checks shared by both completion routes

    def check_model(self, model: str) -> None:
        if model != self.served_name:
            raise APIError(
                404,
                f"model '{printable(model)}' is not served here; this server serves '{self.served_name}'",
                param="model",
                code="model_not_found",
            )

    def log_ignored_fields(self, body: RequestModel, route: str) -> None:
        if ignored := body.ignored_fields():
            names = ", ".join(printable(name, 64) for name in ignored[:MAX_LOGGED_FIELDS])
            more = f" and {len(ignored) - MAX_LOGGED_FIELDS} more" if len(ignored) > MAX_LOGGED_FIELDS else ""
            log.info("%s: ignoring unsupported fields %s%s", route, names, more)

    def engine_params(
        self,
        req: SamplingFields,
        prompt_len: int,
        budget: int | None,
        prompt_param: str,
        stop_token_ids: Sequence[int] = (),
    ) -> list[SamplingParams]:
        """One SamplingParams per sample. The completion budget is clamped to the room the context leaves; sample i
        of a seeded request uses seed + i; an unseeded request passes no seed, and the engine draws one (vLLM then
        keeps its batched sampling path, which a per-request seed would leave)."""
        if req.n > self.cfg.max_n:
            raise APIError(400, f"n={req.n} is larger than this server's limit ({self.cfg.max_n})", param="n")
        room = self.engine.max_model_len - prompt_len
        if room < 1:
            raise context_length_error(prompt_len, self.engine.max_model_len, prompt_param)
        params = SamplingParams(
            max_tokens=min(budget or room, room),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            stop=req.stop_strings(),
            stop_token_ids=list(stop_token_ids),
            ignore_eos=req.ignore_eos,
        )
        if req.seed is None:
            return [params] * req.n
        return [replace(params, seed=req.seed + i) for i in range(req.n)]

    def start_streams(self, prompt_ids: list[int], params: list[SamplingParams], request_id: str):
        """Submit every sample to the engine; the engine's own checks (context length, state) become 4xx/503 here,
        before any response byte is sent."""
        streams = []
        try:
            for i, p in enumerate(params):
                streams.append(self.engine.generate(prompt_ids, p, f"{request_id}-{i}"))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="service_unavailable", code="engine_unavailable") from None
        return streams

    def version_headers(self) -> dict[str, str]:
        return {POLICY_VERSION_HEADER: str(self.engine.policy_version)}

    # ---- /v1/chat/completions

    async def chat(self, req: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        self.log_ignored_fields(req, "chat")
        self.check_model(req.model)
        tools = req.tools if req.tool_choice != "none" else None
        tokenizer = self.engine.tokenizer
        prompt_ids = render_chat(tokenizer, req.messages, tools, req.chat_template_kwargs)
        params = self.engine_params(req, len(prompt_ids), req.completion_budget(), "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self.start_streams(prompt_ids, params, request_id)
        if req.stream:
            return StreamingResponse(
                self._chat_events(req, request_id, streams, len(prompt_ids), hold_tool_calls=bool(tools)),
                media_type="text/event-stream",
                headers={**self.version_headers(), "Cache-Control": "no-cache"},
            )
        started = time.perf_counter()
        samples = await asyncio.gather(*(_collect(s) for s in streams))
        choices = []
        for index, sample in enumerate(samples):
            text = cut_at_stop(tokenizer.decode(sample.token_ids, skip_special_tokens=True), params[index].stop)
            content, calls = split_tool_calls(text) if tools else (text, [])
            choices.append(
                ChatChoice(
                    index=index,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    finish_reason=_finish_reason(sample.finish, bool(calls)),
                    logprobs=self._chat_logprobs(req, sample.token_ids, sample.logprobs),
                    policy_versions=sample.policy_versions(),
                )
            )
        usage = _usage(len(prompt_ids), samples)
        self._log_done("chat", request_id, usage, started, samples)
        body = ChatCompletion(
            id=request_id, created=int(time.time()), model=self.served_name, choices=choices, usage=usage
        )
        return JSONResponse(body.model_dump(mode="json"), headers=self.version_headers())

    def _chat_logprobs(self, req: ChatCompletionRequest, token_ids: list[int], logprobs: list[float]):
        if not req.logprobs:
            return None
        entries = []
        for token_id, logprob in zip(token_ids, logprobs, strict=True):
            piece = self.engine.tokenizer.decode([token_id])
            top = TopLogprob(token=piece, logprob=logprob, bytes=list(piece.encode()))
            entries.append(TokenLogprob(**top.model_dump(), top_logprobs=[top] if req.top_logprobs else []))
        return ChoiceLogprobs(content=entries)

    async def _chat_events(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        streams: list[AsyncIterator[Event]],
        prompt_len: int,
        hold_tool_calls: bool,
    ) -> AsyncIterator[str]:
        started = time.perf_counter()
        created = int(time.time())

        def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
            body = ChatCompletionChunk(
                id=request_id, created=created, model=self.served_name, choices=choices, usage=usage
            )
            return f"data: {body.model_dump_json()}\n\n"

        tokenizer = self.engine.tokenizer
        stops = req.stop_strings()
        texts = [CompletionText(tokenizer, stops, hold_tool_calls) for _ in streams]
        samples = [Sample() for _ in streams]
        yield chunk([ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content="")) for i in range(len(streams))])
        try:
            async for index, event in _merge(streams):
                samples[index].add(event)
                if isinstance(event, TokenEvent):
                    delta = texts[index].push(event.token_id)
                    logprobs = self._chat_logprobs(req, [event.token_id], [event.logprob])
                    if delta or logprobs:
                        yield chunk([ChunkChoice(index=index, delta=ChunkDelta(content=delta), logprobs=logprobs)])
                    continue
                rest = texts[index].finish()
                content, calls = split_tool_calls(rest) if hold_tool_calls else (rest, [])
                tool_deltas = [
                    ToolCallDelta(index=k, id=c.id, function=FunctionCallDelta(**c.function.model_dump()))
                    for k, c in enumerate(calls)
                ]
                yield chunk(
                    [
                        ChunkChoice(
                            index=index,
                            delta=ChunkDelta(content=content or None, tool_calls=tool_deltas or None),
                            finish_reason=_finish_reason(event, bool(calls)),
                            policy_versions=samples[index].policy_versions(),
                        )
                    ]
                )
        except Exception as error:  # the status line is gone: report in-band, as vLLM does
            log.exception("chat %s failed mid-stream", request_id)
            yield f"data: {json.dumps(APIError(500, f'generation failed: {error}', type='server_error').body())}\n\n"
            return
        usage = _usage(prompt_len, samples)
        if req.include_usage():
            yield chunk([], usage)
        yield "data: [DONE]\n\n"
        self._log_done("chat(stream)", request_id, usage, started, samples)

    # ---- /inference/v1/generate

    async def generate(self, req: GenerateRequest) -> JSONResponse:
        self.log_ignored_fields(req, "generate")
        self.log_ignored_fields(req.sampling_params, "generate.sampling_params")
        self.check_model(req.model)
        vocab = len(self.engine.tokenizer)
        if (bad := next((t for t in req.token_ids if not 0 <= t < vocab), None)) is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="token_ids")
        sp = req.sampling_params
        request_id = req.request_id or f"gen-{uuid.uuid4().hex}"
        started = time.perf_counter()
        prompt_logprobs = None if sp.prompt_logprobs is None else await self._prompt_logprobs(req.token_ids)
        if sp.max_tokens == 0:  # scoring only
            finish = Finish("length", (self.engine.policy_version,) * 2, len(req.token_ids), 0)
            samples = [Sample(finish=finish) for _ in range(sp.n)]
        else:
            params = self.engine_params(sp, len(req.token_ids), sp.max_tokens, "token_ids", sp.stop_token_ids or ())
            streams = self.start_streams(req.token_ids, params, f"{request_id}-{uuid.uuid4().hex[:8]}")
            samples = await asyncio.gather(*(_collect(s) for s in streams))
        choices = [
            GenerateChoice(
                index=index,
                token_ids=sample.token_ids,
                finish_reason=_finish_reason(sample.finish, False),
                logprobs=None
                if sp.logprobs is None
                else GenerateLogprobs(
                    content=[
                        TokenIdLogprob(token=f"token_id:{t}", logprob=lp)
                        for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)
                    ]
                ),
                policy_versions=sample.policy_versions(),
                token_policy_versions=sample.token_versions,
            )
            for index, sample in enumerate(samples)
        ]
        usage = _usage(len(req.token_ids), samples)
        self._log_done("generate", request_id, usage, started, samples)
        body = GenerateResponse(request_id=request_id, prompt_token_ids=req.token_ids, choices=choices, usage=usage,
                                prompt_logprobs=prompt_logprobs)
        return JSONResponse(body.model_dump(mode="json"), headers=self.version_headers())

    async def _prompt_logprobs(self, token_ids: list[int]) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's `prompt_logprobs` of `token_ids`: None for the first token, then {"<id>": {"logprob": x}}."""
        if len(token_ids) > self.engine.max_model_len:
            raise context_length_error(len(token_ids), self.engine.max_model_len, "token_ids")
        try:
            logprobs = await self.engine.prompt_logprobs(token_ids)
        except NotImplementedError as e:
            raise APIError(400, str(e), param="sampling_params.prompt_logprobs") from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="service_unavailable", code="engine_unavailable") from None
        return [None] + [{str(t): PromptLogprob(logprob=lp)} for t, lp in zip(token_ids[1:], logprobs, strict=True)]

    # ---- /admin/*

    def admin_error(self, authorization: str) -> APIError | None:
        """The 401 for an `Authorization` header that does not carry the admin token, else None."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.admin_token.encode()):
            return None
        return APIError(
            401,
            "admin routes need 'Authorization: Bearer <admin token>'",
            type="authentication_error",
            code="invalid_admin_token",
        )

    async def update_weights(self, req: UpdateWeightsRequest) -> AdminState:
        path = Path(req.path)
        try:
            found = path.exists()
        except OSError as e:  # a name too long for the filesystem, ...
            raise APIError(400, f"no weights at {printable(req.path)}: {e.strerror}", param="path",
                           code="weights_not_found") from None
        if not found:
            raise APIError(400, f"no weights at {printable(req.path)}", param="path", code="weights_not_found")
        if path.is_dir() and (path / weight_snapshots.SHARED).is_file():
            return await self._load_shared(path, req.step)
        marker = weight_snapshots.broadcast_marker(path) if path.is_dir() else None
        if marker is not None and self.engine.policy_version >= req.step:
            # the trainer publishes a broadcast marker only after every receiver applied it: confirm, load nothing
            log.info("weights: step %d is live (received by broadcast %s)", req.step, marker.get("transfer_id"))
            return self.admin_state()
        if marker is not None and not weight_snapshots.has_files(path):
            raise APIError(
                400,
                f"weights step {req.step} were broadcast to the trainer's weight group and this server does not hold "
                f"them (it serves policy version {self.engine.policy_version}; weight receiver: "
                f"{self.engine.receiver_state}); load a full snapshot instead",
                param="path",
                code="weights_not_received",
            )
        async with self._admin_lock:
            identity = _snapshot_identity(path)
            if self.engine.policy_version == req.step and self._loaded_snapshot == identity:
                # a retried request (its first attempt's answer was lost with the connection): already live
                log.info("weights: step %d from %s is already live", req.step, path)
                return self.admin_state()
            started = time.perf_counter()
            try:
                await self.engine.update_weights(path, req.step)
            except (OSError, ValueError, KeyError) as e:
                raise APIError(400, f"could not load weights from {printable(req.path)}: {e}", param="path") from None
            self._loaded_snapshot = identity
            log.info("weights: loaded %s as policy version %d in %.2fs", printable(req.path), req.step,
                     time.perf_counter() - started)
        return self.admin_state()

    async def _load_shared(self, path: Path, step: int) -> AdminState:
        """Copy version `step` from the trainer's shared buffer (see primerl.transport.shared), then confirm it."""
        from primerl.transport import shared as shared_weights

        run_dir = path.parent.parent
        async with self._admin_lock:
            if self.engine.policy_version == step and self._loaded_snapshot == ("shared", step):
                log.info("weights: step %d (shared) is already live", step)
                return self.admin_state()
            started = time.perf_counter()
            try:
                await self.engine.load_shared_weights(path, run_dir, step)
            except NotImplementedError as e:
                raise APIError(400, f"{e}; use a full snapshot", param="path", code="weights_not_loadable") from None
            except (OSError, ValueError, KeyError, shared_weights.SharedWeightsError) as e:
                raise APIError(400, f"could not load shared weights for step {step}: {e}", param="path") from None
            shared_weights.write_applied(run_dir, step)
            self._loaded_snapshot = ("shared", step)
            log.info("weights: copied step %d from the trainer's shared buffer as policy version %d in %.3fs",
                     step, step, time.perf_counter() - started)
        return self.admin_state()

    async def set_paused(self, paused: bool) -> AdminState:
        async with self._admin_lock:
            await (self.engine.pause() if paused else self.engine.resume())
            self.paused = paused
            log.info("engine %s", "paused" if paused else "resumed")
        return self.admin_state()

    def admin_state(self) -> AdminState:
        return AdminState(policy_version=self.engine.policy_version, paused=self.paused)

    # ---- logging

    def _log_done(self, route: str, request_id: str, usage: Usage, started: float, samples: Sequence[Sample]) -> None:
        log.info(
            "%s %s n=%d prompt=%d completion=%d finish=%s version=%d %.2fs",
            route,
            printable(request_id),
            len(samples),
            usage.prompt_tokens,
            usage.completion_tokens,
            ",".join(_finish_reason(s.finish, False) for s in samples),
            self.engine.policy_version,
            time.perf_counter() - started,
        )


def _snapshot_identity(path: Path) -> tuple:
    """What tells two loads of `path` apart: the path and its files' sizes and modification times (a snapshot
    re-published under the same step after a resume is a different snapshot)."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return (str(path.resolve()), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()))


def _finish_reason(finish: Finish | None, has_tool_calls: bool) -> str:
    reason = finish.reason if finish is not None else "abort"
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def _usage(prompt_tokens: int, samples: Sequence[Sample]) -> Usage:
    completion = sum(len(s.token_ids) for s in samples)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


# ---------------------------------------------------------------------------------------------------------------------
# The FastAPI app


def create_app(engine: Engine, cfg: InferenceConfig) -> FastAPI:
    """The HTTP app over `engine`. The app owns the engine's lifetime: it starts it on startup and stops it on
    shutdown. `cfg.admin_token` must be set (`resolve_admin_token`)."""
    server = InferenceServer(engine, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log.info("serving %s on http://%s:%d", describe_engine(engine), cfg.host, cfg.port)
        if cfg.weight_transfer == "broadcast":
            await engine.start_weight_receiver(cfg.weight_broadcast)
        try:
            yield
        finally:
            await engine.stop()
            log.info("engine stopped")

    app = FastAPI(title="primerl inference", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    _install_error_handlers(app)
    # outermost first: the token is checked before anything reads the body, then completions are admitted
    app.add_middleware(AdmissionLimit, limit=cfg.max_concurrent_requests, paths=COMPLETION_ROUTES)
    app.add_middleware(AdminGate, server=server)

    @app.get("/health", response_model=Health, responses=_errors(503))
    async def health() -> JSONResponse:
        ok = engine.healthy()
        body = Health(
            status="ok" if ok else "unavailable",
            model=server.served_name,
            policy_version=engine.policy_version,
            paused=server.paused,
        )
        return JSONResponse(body.model_dump(mode="json"), status_code=200 if ok else 503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(
            id=server.served_name,
            created=server.created,
            max_model_len=engine.max_model_len,
            policy_version=engine.policy_version,
        )
        return ModelList(data=[card])

    @app.post("/v1/chat/completions", responses=_errors(400, 404, 429, 503))
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        return await server.chat(req)

    @app.post("/inference/v1/generate", responses=_errors(400, 404, 429, 503))
    async def generate(req: GenerateRequest) -> Any:
        return await server.generate(req)

    @app.post("/admin/update_weights", responses=_errors(400, 401))
    async def update_weights(req: UpdateWeightsRequest) -> AdminState:
        return await server.update_weights(req)

    @app.post("/admin/pause", responses=_errors(401))
    async def pause() -> AdminState:
        return await server.set_paused(True)

    @app.post("/admin/resume", responses=_errors(401))
    async def resume() -> AdminState:
        return await server.set_paused(False)

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

    def __init__(self, app: Any, server: InferenceServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/admin/"):
            headers = dict(scope["headers"])
            error = self.server.admin_error(headers.get(b"authorization", b"").decode("latin-1"))
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


# ---------------------------------------------------------------------------------------------------------------------
# Process entry point


def build_engine(cfg: InferenceConfig) -> Engine:
    """The engine `cfg.engine` names, not started. Raises EngineUnavailable when its package is missing."""
    served_name = cfg.served_model_name or cfg.model.name
    if cfg.engine == "vllm":
        from primerl.inference.engines.vllm import VLLMEngine

        return VLLMEngine(
            cfg.model, served_name, max_model_len=cfg.max_model_len, options=cfg.vllm, max_batch_size=cfg.max_batch_size,
            seed=cfg.seed,
        )
    from primerl.inference.engines.hf import HFEngine
    from primerl.models import resolve_model

    return HFEngine(
        resolve_model(cfg.model.name, cfg.model.revision),
        model_name=served_name,
        device=cfg.device,
        dtype=cfg.model.dtype,
        max_batch_size=cfg.max_batch_size,
        max_model_len=cfg.max_model_len,
        decode_steps=cfg.decode_steps,
        overlap=cfg.overlap,
        compile=cfg.compile,
        threads=cfg.threads,
        seed=cfg.seed,
    )


def describe_engine(engine: Engine) -> str:
    """The facts a user needs to trust what is served: model, engine, size, dtype, device, context length."""
    model = getattr(engine, "model", None)
    n_params = sum(p.numel() for p in model.parameters()) if model is not None and hasattr(model, "parameters") else 0
    size = f"{n_params / 1e6:.1f}M params" if n_params else "params unknown"
    return (
        f"model={engine.model_name} engine={type(engine).__name__} {size} dtype={getattr(engine, 'dtype', '?')} "
        f"device={getattr(engine, 'device', '?')} max_model_len={engine.max_model_len} "
        f"max_batch_size={getattr(engine, 'max_batch_size', '?')} policy_version={engine.policy_version}"
    )


def resolve_admin_token(cfg: InferenceConfig) -> None:
    """Make sure `cfg.admin_token` is set: the configured one (PRIMERL_ADMIN_TOKEN), else a fresh random token.
    With `admin_token_file` the token in use is written there (mode 0600, atomically); a generated token without a
    file is printed once on stderr, since nobody could use the admin routes otherwise."""
    generated = cfg.admin_token is None
    if generated:
        cfg.admin_token = secrets.token_urlsafe(32)  # type: ignore[assignment]  # validated into a SecretStr
    token = cfg.admin_token.get_secret_value()  # type: ignore[union-attr]
    if cfg.admin_token_file is not None:
        path = cfg.admin_token_file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
        log.info("admin token %s, written to %s", "generated" if generated else "from config", path)
    elif generated:
        print(f"primerl inference: admin token (set PRIMERL_ADMIN_TOKEN to choose one): {token}", file=sys.stderr)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, made with an explicit IPPROTO_TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    on connections from a socket that says it is TCP. With Nagle on, a response's body (written after its headers)
    waits for the client's delayed ACK, 40 ms on Linux, on every request over a kept-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv(InferenceConfig, argv, prog="primerl inference")
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    import uvicorn

    from primerl.inference.engines.hf import HFEngine
    from primerl.inference.engines.vllm import EngineUnavailable
    from primerl.models import ModelError

    try:
        engine = build_engine(cfg)
    except (EngineUnavailable, ModelError) as e:
        print(f"primerl inference: {e}", file=sys.stderr)
        return 2
    if isinstance(engine, HFEngine) and engine.device.type == "cpu":  # before it loads the model (at start):
        # every new policy version re-packs the weights for oneDNN into fresh blocks: reuse the freed ones instead of
        # faulting in new pages each time (benchmarks/NOTES.md, "Where the first 30 s of a CPU run go")
        keep_freed_memory()
    try:
        sock = _listen(cfg.host, cfg.port)
    except OSError as e:
        print(f"primerl inference: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}", file=sys.stderr)
        return 2
    resolve_admin_token(cfg)
    cfg.port = sock.getsockname()[1]  # the port actually bound (port 0 = any free one)
    log.info("loading %s with engine %s, listening on %s:%d", cfg.model.name, cfg.engine, cfg.host, cfg.port)
    app = create_app(engine, cfg)
    config = uvicorn.Config(
        app, log_config=None, access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, lifespan="on",
        timeout_keep_alive=int(cfg.keep_alive_s),
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a graceful shutdown
        pass
    return 0
