"""Text around the token engine: chat templates in, completion text and Hermes-style tool calls out.

- `render_chat` turns OpenAI chat messages (and tools) into prompt ids with the model's own chat template.
- `CompletionText` turns a stream of sampled ids into text deltas: it decodes incrementally, cuts the text before the
  first stop string, and, when the request offered tools, holds back everything from `<tool_call>` on so streamed
  content never shows half a tool call.
- `split_tool_calls` parses `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes/Qwen format)
  out of a completion into OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from primerl.inference.protocol import APIError, ChatMessage, FunctionCall, ToolCall, ToolSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the default one, or the dedicated tool-use one
        return "tool_use" in template or "tools" in template.get("default", "")
    return isinstance(template, str) and "tools" in template


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates expect it: plain-text content, tool-call arguments as a mapping."""
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c.function)}}
            for c in message.tool_calls
        ]
    return out


def _arguments(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    tools: list[ToolSpec] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt ids for `messages` under the model's chat template, ending with the assistant generation prompt.
    Raises APIError(400) when the template rejects the conversation or cannot take tools."""
    if tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; use /inference/v1/generate with token ids")
    if tools and not template_supports_tools(tokenizer):
        raise APIError(400, "the chat template of this model does not support tools", param="tools")
    try:
        text = tokenizer.apply_chat_template(
            [_template_message(m) for m in messages],
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except (TemplateError, TypeError, ValueError) as e:  # `raise_exception` in a template raises TemplateError
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def cut_at_stop(text: str, stop: list[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    return text[: min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))]


def split_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content without the tool-call blocks, parsed calls). A block whose body is not `{"name", "arguments"}`
    JSON stays in the content, so nothing the model wrote is lost."""
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return match.group(0)
        arguments = body.get("arguments", {})
        calls.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(
                    name=body["name"], arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)
                ),
            )
        )
        return ""

    content = _TOOL_CALL_BLOCK.sub(take, text).strip() if TOOL_CALL_OPEN in text else text
    return (content or None) if calls else text, calls


class CompletionText:
    """Incremental text of one completion.

    `push(token_id)` returns the text that became safe to show: decoded (never half a UTF-8 character), before any
    stop string, and not a possible beginning of a stop string or (with `hold_tool_calls`) of a `<tool_call>` block.
    `text` is the whole completion, cut before the first stop string; `finish()` returns what was held back.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], hold_tool_calls: bool = False) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._hold = [*stop, TOOL_CALL_OPEN] if hold_tool_calls else list(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids before this are decoded and settled
        self._read_offset = 0  # ids before this have been turned into text
        self._decoded = ""
        self._sent = 0

    @property
    def text(self) -> str:
        return cut_at_stop(self._decoded, self._stop)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        self._decode_pending(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Everything not yet released, cut before the first stop string (tool-call blocks included). A completion
        that ends inside a UTF-8 sequence ends with U+FFFD, as a one-shot decode of its ids would."""
        self._decode_pending(final=True)
        return self._release(final=True)

    def _decode_pending(self, final: bool) -> None:
        # Decode a short window that starts a few settled ids back, so tokenizers that merge spaces or bytes across
        # token boundaries get the context they need; the window's settled part is already in `_decoded`.
        settled = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(settled) or (window.endswith("\ufffd") and not final):
            return  # a special token, or an incomplete UTF-8 sequence: wait for the next token
        self._decoded += window[len(settled) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _release(self, final: bool) -> str:
        text = self.text
        end = len(text)
        if not final:
            for marker in self._hold:
                found = text.find(marker, self._sent)
                if found >= 0:
                    end = min(end, found)
                    continue
                # hold back a suffix that could still grow into the marker
                for k in range(min(len(marker) - 1, len(text) - self._sent), 0, -1):
                    if text.endswith(marker[:k]):
                        end = min(end, len(text) - k)
                        break
        if end <= self._sent:
            return ""
        out, self._sent = text[self._sent : end], end
        return out
