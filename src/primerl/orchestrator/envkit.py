"""What a primerl environment package builds on: the in-process chat harness and pinned package data.

An environment is a verifiers taskset package (its module exports one `vf.Taskset` subclass, optionally one `vf.Env`
subclass for multi-turn games, and one `vf.Harness` subclass: `ChatHarness` or a subclass of it). verifiers resolves the
taskset's default harness by id, so exporting the harness is what makes every rollout run in-process: no subprocess, no
package install per rollout.

`ChatHarness` contract: each segment runs one chat loop against the rollout's interception endpoint (model calls are
recorded there, token ids included when the run's client is the renderer client); the model's tool calls are answered
by the harness's `tools` (plain Python functions, executed in-process) and `runtime_tools` (tools that execute in the
rollout's runtime); a reply without tool calls ends the segment. Multi-turn exchanges resume on the accumulated
conversation (`SUPPORTS_RESUME`). `ChatHarness` itself is also the harness id `primerl-chat`: what a taskset without
a harness of its own runs with.

`ShellHarness` gives the model a `shell` tool whose commands run in the rollout's runtime: it executes model-written
code, so it runs in a container runtime (docker) unless the user allows unsandboxed tools (see `rollouts.load_env`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult
from verifiers.v1.runtimes.docker.egress import _CALLBACK_PREFIX as CALLBACK_PREFIX


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


def verify_generated(
    config: vf.TasksetConfig, rows: list[Any], pinned_sha256: str, ignore: Iterable[str] = ()
) -> None:
    """Check rows generated under the default generator settings (every field a taskset config adds to
    `vf.TasksetConfig`, less those in `ignore`, which do not change the rows) against the package's pinned hash;
    other settings make other splits, which are not pinned."""
    own = set(type(config).model_fields) - set(vf.TasksetConfig.model_fields) - set(ignore)
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


INTERCEPTION_ATTEMPTS = 4
"""Tries of one model call when the connection to the interception endpoint fails (each with the same
`Idempotency-Key`, so the endpoint answers a retry of a call it already took with that call's turn, never a second)."""


class InterceptionCallFailed(Exception):
    """A model call the interception endpoint refused (an HTTP error: a stop condition, a failed upstream call), or
    could not be reached after `INTERCEPTION_ATTEMPTS` tries."""


async def complete(http: aiohttp.ClientSession, url: str, secret: str, request: dict[str, Any]) -> dict[str, Any]:
    """POST one chat-completions `request` to the interception endpoint `url` and return the assistant message.

    A plain aiohttp call rather than the OpenAI SDK: the harness and the interception server share this process's
    event loop, and the SDK's client construction, request transformation, response models and httpx's connection
    pool cost more CPU per rollout than the rest of the hop. Connection failures (the connection reset, the request
    body or the answer cut off) are retried with the same body and `Idempotency-Key`: verifiers' interception server
    then coalesces the retry onto the call it is already serving, or replays the answer it already gave, so a turn is
    never sampled or recorded twice."""
    body = json.dumps(request).encode()
    headers = {
        "Authorization": f"Bearer {secret}", "Content-Type": "application/json", "Idempotency-Key": uuid.uuid4().hex,
    }
    for attempt in range(1, INTERCEPTION_ATTEMPTS + 1):
        try:
            async with http.post(url, data=body, headers=headers) as response:
                answer = await response.read()
                status = response.status
            break
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            if attempt == INTERCEPTION_ATTEMPTS:
                raise InterceptionCallFailed(
                    f"interception endpoint unreachable after {attempt} tries: {type(error).__name__}: {error}"
                ) from error
            await asyncio.sleep(0.05 * attempt)
    if status >= 400:
        raise InterceptionCallFailed(f"HTTP {status}: {answer.decode(errors='replace')}")
    message = json.loads(answer)["choices"][0]["message"]
    return {key: value for key, value in message.items() if value is not None}


def in_process_endpoint(endpoint: str, runtime: vf.Runtime) -> str:
    """The interception endpoint as this process reaches it. verifiers hands a harness the endpoint its program would
    use from inside the runtime: a container runtime turns the host-loopback URL into a route of its egress proxy
    (`/.vf-host/<token>/...` on a port inside the container), which only the container can reach. An in-process harness
    maps it back through the proxy's callback table (verifiers has no public accessor for it)."""
    parts = urlsplit(endpoint)
    proxy = getattr(runtime, "_proxy", None)
    if proxy is None or not parts.path.startswith(CALLBACK_PREFIX):
        return endpoint
    token, _, path = parts.path[len(CALLBACK_PREFIX) :].partition("/")
    callback = proxy._callbacks.get(token)
    if callback is None:
        raise vf.HarnessError(f"the runtime's egress proxy knows no callback route for {endpoint}")
    return urlunsplit((callback.scheme, callback.authority, f"/{path}", parts.query, ""))


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
        """The in-process tools offered to the model on every turn (none by default)."""
        return []

    def runtime_tools(self, runtime: vf.Runtime) -> list[Tool]:
        """Tools that act in this rollout's `runtime` (none by default). A harness that returns any must set
        `EXECUTES_CODE = True`, so it is never run unsandboxed on the host unless the user allows it."""
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
        tools = {tool.name: tool for tool in [*self.tools(), *self.runtime_tools(runtime)]}
        specs = [tool.spec() for tool in tools.values()]
        url = f"{in_process_endpoint(endpoint, runtime).rstrip('/')}/chat/completions"
        # One connection per rollout, closed with it: no pooled connection outlives its rollout, so none is reused
        # after the interception server has closed it.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            try:
                await self._chat(http, url, secret, ctx.model, messages, tools, specs)
            except InterceptionCallFailed as error:
                # The interception refused or failed the call; the trace says why (a stop condition, or the error).
                return ProgramResult(exit_code=1, stdout="", stderr=f"{type(error).__name__}: {error}")
        return ProgramResult(exit_code=0, stdout="", stderr="")

    async def _chat(
        self,
        http: aiohttp.ClientSession,
        url: str,
        secret: str,
        model: str,
        messages: list[dict[str, Any]],
        tools: dict[str, Tool],
        specs: list[dict[str, Any]],
    ) -> None:
        for _ in range(self.config.max_tool_rounds + 1):
            message = await complete(
                http, url, secret, {"model": model, "messages": messages, **({"tools": specs} if specs else {})}
            )
            messages.append(message)
            if not message.get("tool_calls"):
                return
            for call in message["tool_calls"]:
                name, arguments = call["function"]["name"], call["function"].get("arguments")
                tool = tools.get(name)
                content = (
                    await tool.call(arguments)
                    if tool is not None
                    else f"error: unknown tool {name!r}; available: {', '.join(tools) or 'none'}"
                )
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": content})


class ShellHarnessConfig(ChatHarnessConfig):
    command_timeout_s: float = 30.0
    """A `shell` command running longer than this is stopped (coreutils `timeout` in the runtime); the model sees a
    timeout error."""
    max_output_chars: int = 4000
    """The tool result keeps the last this many characters of the command's output."""


TIMEOUT_EXIT, TIMEOUT_KILLED_EXIT = 124, 137  # coreutils `timeout`: the command timed out / needed SIGKILL


class ShellHarness(ChatHarness, vf.Harness[ShellHarnessConfig]):
    """`ChatHarness` with a `shell` tool: `sh -c <command>` in the rollout's runtime (a container with the docker
    runtime). The model's code runs there, never in the orchestrator."""

    EXECUTES_CODE = True

    def runtime_tools(self, runtime: vf.Runtime) -> list[Tool]:
        async def shell(command: str) -> str:
            # `timeout` runs inside the runtime, so an overlong command is killed there, not left behind.
            limit = f"{self.config.command_timeout_s:g}"
            result = await runtime.run(["timeout", "-k", "5", limit, "sh", "-c", command], {})
            if result.exit_code in (TIMEOUT_EXIT, TIMEOUT_KILLED_EXIT):
                return f"error: the command ran longer than {limit}s and was stopped"
            output = (result.stdout + result.stderr)[-self.config.max_output_chars :]
            return f"exit code {result.exit_code}\n{output}"

        return [
            Tool(
                name="shell",
                description="Run a shell command (sh -c) in your sandbox; returns its exit code and output.",
                parameters={
                    "type": "object",
                    "properties": {"command": {"type": "string", "description": "the command line"}},
                    "required": ["command"],
                },
                fn=shell,
            )
        ]
