"""The in-process harness's model calls survive a connection to the interception endpoint that breaks mid-request.

The failure seen in GPU runs: the interception server logged "request body cut off" / `ConnectionResetError` and the
rollout was lost, because the harness's client (the OpenAI SDK, no retries) gave up on the first broken connection.
Here a real socket server cuts the first connection after the request's headers and part of its body, as that log
describes; the harness retries with the same body and `Idempotency-Key` (verifiers' interception server answers such
a retry with the turn it already took, never a second one) and the call succeeds.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp
import pytest

from primerl.orchestrator.envkit import INTERCEPTION_ATTEMPTS, InterceptionCallFailed, complete

ANSWER = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "olleh", "tool_calls": None}}]}
REQUEST = {"model": "tiny", "messages": [{"role": "user", "content": "reverse: hello " + "x" * 5000}]}


@dataclass
class CuttingServer:
    """An HTTP/1.1 endpoint on loopback that cuts the first `cuts` connections after the headers and part of the
    body, then answers `status` with `ANSWER`. It records each complete request it answered."""

    cuts: int
    status: int = 200
    attempts: int = 0
    answered: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed its connection
                return
            lines = head.decode().split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
            length = int(headers["content-length"])
            self.attempts += 1
            if self.attempts <= self.cuts:
                await reader.readexactly(length // 2)
                writer.transport.abort()  # a reset mid-upload: the server's read of the body fails
                return
            body = await reader.readexactly(length)
            self.answered.append((headers, body))
            payload = json.dumps(ANSWER if self.status == 200 else {"error": {"message": "rollout stopped"}}).encode()
            writer.write(f"HTTP/1.1 {self.status} X\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            await writer.drain()

    async def call(self) -> dict:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as http:
                return await complete(http, f"http://127.0.0.1:{port}/v1/chat/completions", "secret", REQUEST)
        finally:
            server.close()


def test_a_call_cut_off_mid_upload_is_retried_with_the_same_body_and_key() -> None:
    server = CuttingServer(cuts=2)
    message = asyncio.run(server.call())
    assert message == {"role": "assistant", "content": "olleh"}  # None fields dropped, as the SDK's dump did
    assert server.attempts == 3 and len(server.answered) == 1
    headers, body = server.answered[0]
    assert json.loads(body) == REQUEST and headers["authorization"] == "Bearer secret"
    assert len(headers["idempotency-key"]) == 32


def test_every_try_of_one_call_carries_one_key_and_the_next_call_another() -> None:
    server = CuttingServer(cuts=0)

    async def two_calls() -> None:
        listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}/v1/chat/completions"
        try:
            async with aiohttp.ClientSession() as http:
                await complete(http, url, "secret", REQUEST)
                await complete(http, url, "secret", REQUEST)
        finally:
            listening.close()

    asyncio.run(two_calls())
    first, second = (headers["idempotency-key"] for headers, _ in server.answered)
    assert first != second  # the same body sent again as a new turn is a new call, never a replay


def test_an_endpoint_that_keeps_cutting_fails_the_call_with_one_error() -> None:
    server = CuttingServer(cuts=INTERCEPTION_ATTEMPTS)
    with pytest.raises(InterceptionCallFailed, match=f"unreachable after {INTERCEPTION_ATTEMPTS} tries"):
        asyncio.run(server.call())
    assert server.attempts == INTERCEPTION_ATTEMPTS and not server.answered


def test_a_refused_call_is_not_retried() -> None:
    server = CuttingServer(cuts=0, status=400)
    with pytest.raises(InterceptionCallFailed, match="HTTP 400: .*rollout stopped"):
        asyncio.run(server.call())
    assert server.attempts == 1
