"""Wire format of the inference server: request and response models of every route, and the error body.

Requests follow the OpenAI chat-completions API and vLLM's token route (`/inference/v1/generate`, the shape
`renderers.client.generate` sends and parses). Like vLLM, unknown request fields are accepted and ignored (the server
logs their names) so clients that send provider-specific extras keep working; a known field with a wrong type or an
out-of-range value is a 400. primerl's one addition to every response is `policy_versions` on each choice: the
sorted, distinct weight versions (trainer steps) that sampled that choice's tokens; the token route adds
`token_policy_versions`, the version that sampled each token (a weight update can land mid-completion).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# ---------------------------------------------------------------------------------------------------------------------
# Client strings

MAX_NAME_CHARS = 256  # `model`, `request_id`: strings the server keeps, logs and echoes
MAX_PATH_CHARS = 4096  # `/admin/update_weights` path


def printable(text: str, limit: int = 200) -> str:
    """`text` (something a client sent) made safe for one log line or error message: control characters, newlines
    and other non-printable characters appear escaped (`\\n`, `\\x1b`, `\\u2028`), and at most `limit` characters
    of it are kept. A client string can then neither forge a log line nor flood the log."""
    cut = text[:limit]
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return escaped + (f"...(+{len(text) - limit} chars)" if len(text) > limit else "")


# ---------------------------------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """A request the server refuses, answered with `status` and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error response: `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape)."""

    error: ErrorDetail


def context_length_error(prompt_tokens: int, max_model_len: int, param: str) -> APIError:
    """The overlong-prompt error, worded like vLLM's so clients that detect context overflow recognise it."""
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your request has "
        f"{prompt_tokens} input tokens. Please reduce the length of the messages.",
        param=param,
        code="context_length_exceeded",
    )


# ---------------------------------------------------------------------------------------------------------------------
# Shared pieces


class RequestModel(BaseModel):
    """A request body: unknown fields are kept aside (see `ignored_fields`), known ones are validated."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class ResponseModel(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


class SamplingFields(RequestModel):
    """Sampling fields both completion routes share (`top_k` is a vLLM extension to the OpenAI API)."""

    n: int = Field(1, ge=1, description="completions to sample for the prompt")
    temperature: float | None = Field(None, ge=0, description="0 = greedy; null = 1")
    top_p: float | None = Field(None, gt=0, le=1, description="null = 1")
    top_k: int = Field(-1, ge=-1, description="-1 = whole vocabulary")
    max_tokens: int | None = Field(None, ge=1, description="null = up to the context length")
    stop: str | list[str] | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: keep sampling past the end-of-sequence token")
    seed: int | None = Field(None, description="completion i of n samples with seed + i")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and "" in ([value] if isinstance(value, str) else value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (whole vocabulary) or >= 1")
        return value

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# ---------------------------------------------------------------------------------------------------------------------
# /v1/chat/completions


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON-encoded arguments, as OpenAI sends them")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(RequestModel):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(RequestModel):
    include_usage: bool = False


class ChatCompletionRequest(SamplingFields):
    model: str = Field(max_length=MAX_NAME_CHARS)
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none", "auto"):
            raise ValueError("only tool_choice 'auto' and 'none' are supported (no constrained decoding)")
        return value

    def completion_budget(self) -> int | None:
        """`max_completion_tokens` (the current OpenAI name) wins over the legacy `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(
        default_factory=list, description="limited to the sampled token: the engine records no alternatives"
    )


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob]


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    policy_versions: list[int]


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(ResponseModel):
    name: str
    arguments: str


class ToolCallDelta(ResponseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallDelta


class ChunkDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(ResponseModel):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    policy_versions: list[int] | None = Field(None, description="set on the choice's last chunk")


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------------------------------
# /inference/v1/generate (token in, token out)


class GenerateSamplingParams(SamplingFields):
    """The vLLM sampling fields this engine honours. `skip_special_tokens` is accepted for compatibility and has no
    effect: this route returns token ids, never text. `prompt_logprobs` (any value >= 0; the engine records no
    alternatives, so each position carries the prompt token's own log-prob only) asks for the log-prob of every
    prompt token given the ones before it, under the model's untempered distribution; with it, `max_tokens` may be
    0: score the tokens, sample nothing."""

    max_tokens: int | None = Field(None, ge=0, description="null = up to the context length; 0 needs prompt_logprobs")
    stop_token_ids: list[int] | None = None
    logprobs: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = Field(None, ge=0)
    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _zero_tokens_only_to_score(self) -> GenerateSamplingParams:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens = 0 samples nothing: it needs prompt_logprobs (score the tokens)")
        return self


class GenerateRequest(RequestModel):
    model: str = Field(max_length=MAX_NAME_CHARS)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    request_id: str | None = Field(None, max_length=MAX_NAME_CHARS, description="echoed in the response")


class TokenIdLogprob(ResponseModel):
    token: str = Field(description="'token_id:<id>'")
    logprob: float


class GenerateLogprobs(ResponseModel):
    content: list[TokenIdLogprob]


class GenerateChoice(ResponseModel):
    index: int
    token_ids: list[int]
    finish_reason: str
    logprobs: GenerateLogprobs | None = None
    policy_versions: list[int]
    token_policy_versions: list[int] = Field(description="the policy version that sampled each of `token_ids`")


class PromptLogprob(ResponseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class GenerateResponse(ResponseModel):
    request_id: str
    prompt_token_ids: list[int]
    choices: list[GenerateChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="with sampling_params.prompt_logprobs: per prompt token, {'<id>': {'logprob': x}} (None for "
        "the first token, which nothing precedes)"
    )


# ---------------------------------------------------------------------------------------------------------------------
# /v1/models, /health, /admin/*


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "primerl"
    max_model_len: int
    policy_version: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(ResponseModel):
    status: Literal["ok", "unavailable"]
    model: str
    policy_version: int
    paused: bool


class UpdateWeightsRequest(RequestModel):
    path: str = Field(
        min_length=1,
        max_length=MAX_PATH_CHARS,
        description="directory with safetensors weights (a run's weights/step_<n>)",
    )
    step: int = Field(ge=0, description="the trainer step these weights come from; becomes the policy version")


class AdminState(ResponseModel):
    policy_version: int
    paused: bool
