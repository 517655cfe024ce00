"""What a primerl environment package builds on: the in-process chat harness and pinned package data.

An environment is a verifiers taskset package (its module exports one `vf.Taskset` subclass, optionally one `vf.Env`
subclass for multi-turn games, and one `vf.Harness` subclass: `ChatHarness` or a subclass of it). verifiers resolves the
taskset's default harness by id, so exporting the harness is what makes every rollout run in-process: no subprocess, no
package install per rollout.

`ChatHarness` contract: each segment runs one chat loop against the rollout's interception endpoint (model calls are
recorded there, token ids included when the run's client is the renderer client); the model's tool calls are answered
by the harness's `tools` (plain Python functions, executed in-process); a reply without tool calls ends the segment.
Multi-turn exchanges resume on the accumulated conversation (`SUPPORTS_RESUME`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import httpx
import verifiers.v1 as vf
from openai import APIError, AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

from primerl.orchestrator.client import pool_limits


class DataIntegrityError(RuntimeError):
    """A package data file whose sha256 differs from the one pinned in the package."""


def read_pinned(package: str, name: str, sha256: str) -> bytes:
    """The bytes of data file `name` shipped inside `package`, after checking them against the pinned `sha256`."""
    data = (resources.files(package) / name).read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise DataIntegrityError(
            f"{package}/{name} has sha256 {actual}, but the package pins {sha256}: the data file was modified; "
            f"reinstall the {package} package"
        )
    return data


def rows_sha256(rows: list[Any]) -> str:
    """sha256 of generated task rows in canonical JSON: what a generated split is pinned by."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def verify_generated(config: vf.TasksetConfig, rows: list[Any], pinned_sha256: str) -> None:
    """Check rows generated under the default generator settings (every field a taskset config adds to
    `vf.TasksetConfig`) against the package's pinned hash; other settings make other splits, which are not pinned."""
    own = set(type(config).model_fields) - set(vf.TasksetConfig.model_fields)
    if config.model_dump(include=own) != type(config)().model_dump(include=own):
        return
    digest = rows_sha256(rows)
    if digest != pinned_sha256:
        raise DataIntegrityError(
            f"the default split of {type(config).__name__} hashes to {digest}, not the pinned {pinned_sha256}: "
            "the generator no longer reproduces the pinned data"
        )


@dataclass(frozen=True)
class Tool:
    """A function the model may call, answered in-process. `fn` takes the call's JSON arguments as keyword
    arguments and returns the text the model sees (sync or async); bad arguments raise `ValueError`/`TypeError`,
    which the harness reports back to the model as the tool result."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str | Awaitable[str]]

    def spec(self) -> dict[str, Any]:
        """The OpenAI `tools` entry advertising this function."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def call(self, arguments: str) -> str:
        """Run the tool on a call's JSON `arguments`; malformed calls come back as an error text, never raise."""
        try:
            kwargs = json.loads(arguments or "{}")
        except json.JSONDecodeError as error:
            return f"error: the arguments are not valid JSON ({error})"
        if not isinstance(kwargs, dict):
            return "error: the arguments must be a JSON object"
        try:
            result = self.fn(**kwargs)
            return await result if inspect.isawaitable(result) else result
        except (TypeError, ValueError) as error:
            return f"error: {error}"


_INTERCEPTION_HTTP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def _interception_http() -> httpx.AsyncClient:
    """One HTTP client per event loop for every rollout's calls to its interception endpoint (plain HTTP on this
    host): a client per rollout would build a TLS context each time, which cost more CPU than the rest of a rollout."""
    loop = asyncio.get_running_loop()
    client = _INTERCEPTION_HTTP.get(loop)
    if client is None or client.is_closed:
        client = _INTERCEPTION_HTTP[loop] = httpx.AsyncClient(timeout=None, limits=pool_limits(), verify=False)
    return client


class ChatHarnessConfig(vf.HarnessConfig):
    max_tool_rounds: int = 8
    """Tool-call rounds one segment may take before the harness stops answering tools and ends the segment."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """A chat loop run inside the orchestrator's event loop; subclasses add tools by overriding `tools()`."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    def tools(self) -> list[Tool]:
        """The tools offered to the model on every turn (none by default)."""
        return []

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> ProgramResult:
        if mcp_urls:
            raise vf.HarnessError("ChatHarness runs tools in-process; declare them in tools(), not as MCP toolsets")
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(message_to_wire(message) for message in prompt)
        tools = {tool.name: tool for tool in self.tools()}
        specs = [tool.spec() for tool in tools.values()]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=_interception_http())
        try:
            await self._chat(client, ctx.model, messages, tools, specs)
        except APIError as error:
            # The interception refused or failed the call; the trace says why (a stop condition, or the error).
            return ProgramResult(exit_code=1, stdout="", stderr=f"{type(error).__name__}: {error}")
        return ProgramResult(exit_code=0, stdout="", stderr="")

    async def _chat(
        self,
        client: AsyncOpenAI,
        model: str,
        messages: list[dict[str, Any]],
        tools: dict[str, Tool],
        specs: list[dict[str, Any]],
    ) -> None:
        for _ in range(self.config.max_tool_rounds + 1):
            completion = await client.chat.completions.create(
                model=model, messages=messages, **({"tools": specs} if specs else {})
            )
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return
            for call in message.tool_calls:
                tool = tools.get(call.function.name)
                content = (
                    await tool.call(call.function.arguments)
                    if tool is not None
                    else f"error: unknown tool {call.function.name!r}; available: {', '.join(tools) or 'none'}"
                )
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": content}
                )
