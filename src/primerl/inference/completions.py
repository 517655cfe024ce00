"""Request handling of the completion routes: `POST /v1/chat/completions` and `POST /inference/v1/generate`.

`Completions` turns a request into engine calls — chat template, seeds, context-length checks, one engine request
per sample — and engine events into responses — text, stop-string cuts, tool calls, logprobs, SSE chunks. Every
choice carries `policy_versions` (the weight versions that sampled it) and every response an `X-Policy-Version`
header (the engine's version when the headers went out). Bad input raises `APIError` (a 4xx, before any response
byte); a failure mid-stream is reported in-band. It knows nothing of HTTP routing, middlewares or the admin routes
(primerl.inference.app).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from primerl.config.inference import InferenceConfig
from primerl.inference.chat import CompletionText, cut_at_stop, render_chat, split_tool_calls
from primerl.inference.engines.base import Engine, Event, Finish, SamplingParams, TokenEvent
from primerl.inference.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    FunctionCallDelta,
    GenerateRequest,
    PromptLogprob,
    RequestModel,
    SamplingFields,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
    context_length_error,
    printable,
)

log = logging.getLogger("primerl.inference")

POLICY_VERSION_HEADER = "X-Policy-Version"
MAX_LOGGED_FIELDS = 20  # ignored request fields named in the log line, at most


# ---------------------------------------------------------------------------------------------------------------------
# Engine side: one sample = one engine request


@dataclass
class CompletionSample:
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


async def _collect(stream: AsyncIterator[Event]) -> CompletionSample:
    sample = CompletionSample()
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
# The completion routes


class Completions:
    """Request handling of the completion routes over one engine: validation, engine calls, response assembly."""

    def __init__(self, engine: Engine, cfg: InferenceConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.served_name = cfg.served_model_name or cfg.model.name
        self.created = int(time.time())

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
        samples = [CompletionSample() for _ in streams]
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
        # The model's own vocabulary: it may sample ids past the tokenizer's (a padded embedding), and a client
        # sends those back in the next turn's prompt.
        vocab = max(self.engine.vocab_size, len(self.engine.tokenizer))
        if (bad := next((t for t in req.token_ids if not 0 <= t < vocab), None)) is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="token_ids")
        sp = req.sampling_params
        request_id = req.request_id or f"gen-{uuid.uuid4().hex}"
        started = time.perf_counter()
        prompt_logprobs = None if sp.prompt_logprobs is None else await self._prompt_logprobs(req.token_ids)
        if sp.max_tokens == 0:  # scoring only
            finish = Finish("length", (self.engine.policy_version,) * 2, len(req.token_ids), 0)
            samples = [CompletionSample(finish=finish) for _ in range(sp.n)]
        else:
            params = self.engine_params(sp, len(req.token_ids), sp.max_tokens, "token_ids", sp.stop_token_ids or ())
            streams = self.start_streams(req.token_ids, params, f"{request_id}-{uuid.uuid4().hex[:8]}")
            samples = await asyncio.gather(*(_collect(s) for s in streams))
        usage = _usage(len(req.token_ids), samples)
        self._log_done("generate", request_id, usage, started, samples)
        return JSONResponse(generate_body(request_id, req.token_ids, samples, sp.logprobs is not None, usage,
                                          prompt_logprobs), headers=self.version_headers())

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

    # ---- logging

    def _log_done(self, route: str, request_id: str, usage: Usage, started: float,
                  samples: Sequence[CompletionSample]) -> None:
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


def generate_body(request_id: str, prompt_ids: list[int], samples: Sequence[CompletionSample], logprobs: bool,
                  usage: Usage, prompt_logprobs: list[dict[str, PromptLogprob] | None] | None) -> dict[str, Any]:
    """The token route's response, `GenerateResponse`'s JSON form, built as plain data: a reply of n x max_tokens
    tokens would otherwise make a model object per token and dump each back, on the event loop, whose time a GPU
    engine loses (benchmarks/NOTES.md, "The server's own CPU per token"). A test checks that `GenerateResponse`
    validates this body and dumps it unchanged."""
    return {
        "request_id": request_id,
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": index,
                "token_ids": sample.token_ids,
                "finish_reason": _finish_reason(sample.finish, False),
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                         for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)]}
                if logprobs else None,
                "policy_versions": sample.policy_versions(),
                "token_policy_versions": sample.token_versions,
            }
            for index, sample in enumerate(samples)
        ],
        "usage": usage.model_dump(mode="json"),
        "prompt_logprobs": None if prompt_logprobs is None else [
            None if entry is None else {token: value.model_dump(mode="json") for token, value in entry.items()}
            for entry in prompt_logprobs
        ],
    }


def _finish_reason(finish: Finish | None, has_tool_calls: bool) -> str:
    reason = finish.reason if finish is not None else "abort"
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def _usage(prompt_tokens: int, samples: Sequence[CompletionSample]) -> Usage:
    completion = sum(len(s.token_ids) for s in samples)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
