"""The orchestrator's connections to its inference servers: one or many, and none of them dropped.

Contract:
- Idle pooled connections are retired after `KEEPALIVE_EXPIRY_S`, below the server's keep-alive
  (`inference.keep_alive_s`, 75 s by default): the client closes an idle connection before the server does, so no
  request is written into a connection the server is closing (the race that surfaced as `RemoteProtocolError` /
  `ReadError` when both sides used 5 s). Against a server configured shorter, the retries below cover the race.
- Idempotent calls are retried on transport errors with backoff, within `retry_s` in all: `GET /health`, and
  `POST /admin/update_weights` (the server answers a snapshot it already serves without loading it again). After
  that, one error names the server, the call and the last failure.
- Every connection goes through `AiohttpTransport` (httpx's API on aiohttp's pool: no per-request scan of the pool).
- verifiers' model calls (the renderer client inside its interception server) get the same transport and retry
  connection errors (a request that never reached the server is safe to send again; one that did is aborted by the
  server when its connection closes): `install_model_client_transport()`.
- Several servers: groups go to the least-loaded server; each weight version is loaded into every server; the policy
  version the async bound uses is the oldest any server holds, so the bound holds per server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import aiohttp
import httpx

from primerl.orchestrator.versions import TOKEN_VERSIONS

log = logging.getLogger("primerl.orchestrator")

KEEPALIVE_EXPIRY_S = 4.0
"""Idle pooled connections are closed after this long (primerl's server keeps them 75 s unless told otherwise)."""
MODEL_CALL_RETRIES = 3
_RETRYABLE = (httpx.TransportError,)  # connect, read, write, protocol errors; timeouts are TransportErrors too


class InferenceUnavailable(RuntimeError):
    """A server stayed unreachable (or kept failing) for longer than the retry budget."""


MAX_CONNECTIONS = 1000


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's client API over aiohttp's connection pool, for plain-HTTP servers.

    httpcore's pool scans every connection it holds (a readability poll on each socket) whenever a request starts or
    a response closes: with a hundred rollouts in flight that was the largest CPU cost of a model call in the
    orchestrator (see `benchmarks/NOTES.md`). aiohttp hands out an idle connection without a scan. Idle connections
    are closed after `KEEPALIVE_EXPIRY_S`; no TLS context is built (plain HTTP only). Transport failures surface as
    httpx's (`httpx.ConnectError`, `httpx.ReadError`, `httpx.ReadTimeout`, ...), so retries written against httpx keep
    working; response bodies stream, so a hook may read one before its caller does."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_EXPIRY_S, ssl=False)
            # httpx decodes the body by its Content-Encoding, so aiohttp must hand it over as sent
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"AiohttpTransport serves plain http, not {request.url.scheme}")
        limits = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=limits.get("connect"), sock_read=limits.get("read"), connect=limits.get("pool"),
        )
        try:
            response = await self._open().request(
                request.method, str(request.url), headers=request.headers.multi_items(), data=await request.aread(),
                timeout=timeout, allow_redirects=False, skip_auto_headers=("Accept-Encoding", "User-Agent"),
            )
        except aiohttp.ConnectionTimeoutError as error:
            raise httpx.ConnectTimeout(f"no connection within the timeout: {error}", request=request) from error
        except TimeoutError as error:
            raise httpx.ReadTimeout(f"no answer within the read timeout: {error}", request=request) from error
        except aiohttp.ClientConnectorError as error:
            raise httpx.ConnectError(str(error), request=request) from error
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError) as error:
            raise httpx.ReadError(f"{type(error).__name__}: {error}", request=request) from error
        return httpx.Response(
            response.status, headers=response.raw_headers, stream=_ResponseBody(response, request), request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _ResponseBody(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self):
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except TimeoutError as error:
            raise httpx.ReadTimeout("no answer within the read timeout", request=self._request) from error
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            raise httpx.ReadError(f"{type(error).__name__}: {error}", request=self._request) from error

    async def aclose(self) -> None:
        self._response.release()


def build_http(base_url: str, timeout_s: float) -> httpx.AsyncClient:
    """An async client for plain-HTTP servers on `AiohttpTransport` (no TLS context: building one loads the CA
    bundle, tens of milliseconds of CPU, which per rollout was once the orchestrator's largest single cost)."""
    return httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=10.0), transport=AiohttpTransport()
    )


async def with_retries(call, what: str, retry_s: float) -> httpx.Response:
    """`await call()` until it returns a response, retrying transport errors with backoff for `retry_s` seconds."""
    deadline = time.monotonic() + retry_s
    delay = 0.05
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except _RETRYABLE as error:
            if time.monotonic() + delay > deadline:
                raise InferenceUnavailable(
                    f"{what}: no answer after {attempt} attempt(s) in {retry_s:.0f}s: {type(error).__name__}: "
                    f"{error or 'connection closed'}"
                ) from error
            if attempt == 1 or attempt % 10 == 0:
                log.debug("%s: %s, retrying", what, type(error).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def poll_until_ok(http: httpx.AsyncClient, path: str, timeout_s: float, what: str) -> httpx.Response:
    """GET `path` every half second until it answers 200 (a server still starting refuses or answers otherwise);
    TimeoutError `what after N s` once `timeout_s` have passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = await http.get(path, timeout=10.0)
            if response.status_code == 200:
                return response
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


@dataclass(eq=False)
class Server:
    """One inference server as the orchestrator sees it."""

    url: str
    http: httpx.AsyncClient
    version: int = 0
    """The newest policy version this server is known to serve."""
    in_flight: int = 0
    """Groups running against it."""


class InferencePool:
    """The servers of a run; see the module docstring. Use as `async with InferencePool(...) as pool:`."""

    def __init__(self, urls: list[str], *, admin_token: str | None, request_timeout_s: float, retry_s: float):
        if not urls:
            raise ValueError("at least one inference server URL is needed")
        self.servers = [Server(url.rstrip("/"), build_http(url.rstrip("/"), request_timeout_s)) for url in urls]
        self.admin_token = admin_token
        self.retry_s = retry_s
        self.last_update_s: float | None = None
        self.changed = asyncio.Event()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(server.http.aclose() for server in self.servers), return_exceptions=True)

    @property
    def version(self) -> int:
        """The oldest policy version any server holds (what the async bound must use)."""
        return min(server.version for server in self.servers)

    # ------------------------------------------------------------------------------------------------ health

    async def health(self, server: Server) -> dict[str, Any]:
        response = await with_retries(lambda: server.http.get("/health"), f"GET {server.url}/health", self.retry_s)
        response.raise_for_status()
        body = response.json()
        server.version = max(server.version, int(body["policy_version"]))
        return body

    async def wait_until_serving(self, timeout_s: float) -> None:
        """Wait until every server answers /health with 200 (each may still be loading its model)."""

        async def one(server: Server) -> None:
            response = await poll_until_ok(
                server.http, "/health", timeout_s, f"inference server at {server.url} not healthy"
            )
            server.version = int(response.json()["policy_version"])

        await asyncio.gather(*(one(server) for server in self.servers))

    # ----------------------------------------------------------------------------------------------- routing

    @contextlib.contextmanager
    def acquire(self) -> Iterator[Server]:
        """The least-loaded server, counted as busy until the block ends."""
        server = min(self.servers, key=lambda s: s.in_flight)
        server.in_flight += 1
        try:
            yield server
        finally:
            server.in_flight -= 1

    # ----------------------------------------------------------------------------------------------- weights

    async def update_weights(self, step: int, path: Path) -> bool:
        """Load snapshot `path` as policy version `step` into every server that holds an older one. Returns False
        when a server answered 400 (the snapshot is not loadable yet, or was pruned): look again later."""
        if self.admin_token is None:
            raise RuntimeError("new weights appeared but no admin token is set (PRIMERL_ADMIN_TOKEN)")
        started = time.perf_counter()
        behind = [server for server in self.servers if server.version < step]
        results = await asyncio.gather(*(self._update_one(server, step, path) for server in behind))
        if not all(results):
            return False
        self.last_update_s = time.perf_counter() - started
        if behind:
            log.info(
                "inference now serves policy version %d on %d server(s) (loaded in %.2fs)",
                self.version, len(self.servers), self.last_update_s,
            )
            self.changed.set()
        return True

    async def _update_one(self, server: Server, step: int, path: Path) -> bool:
        response = await with_retries(
            lambda: server.http.post(
                "/admin/update_weights",
                json={"path": str(path), "step": step},
                headers={"Authorization": f"Bearer {self.admin_token}"},
            ),  # bounded by request_timeout_s like every call: a server that stopped answering ends the run
            f"POST {server.url}/admin/update_weights (step {step})",
            self.retry_s,
        )
        if response.status_code == 400:  # pruned or replaced between listing and loading: look again next poll
            log.warning("weights step %d not loadable yet on %s: %s", step, server.url, response.text)
            return False
        response.raise_for_status()
        server.version = int(response.json()["policy_version"])
        return True


def install_model_client_transport(request_timeout_s: float | None = None) -> None:
    """Give the model clients that verifiers' interception servers build (one per endpoint config) primerl's
    transport (`AiohttpTransport`), `MODEL_CALL_RETRIES` retries of connection errors and, with `request_timeout_s`, a bound on how long
    one model call may go without an answer (verifiers waits forever by default: a server that stops answering
    would hang the run silently); every token-route answer they receive goes to `versions.TOKEN_VERSIONS` (the
    per-token policy versions the renderer client drops). verifiers builds them with a 5 s keep-alive expiry, no retries and a TLS context;
    for loopback/cluster HTTP servers that is the idle-connection race and a lost rollout per dropped connection.
    Checked against verifiers' interception module at call time; calling it again updates the timeout."""
    from openai import AsyncOpenAI
    from verifiers.v1.clients import client as clients
    from verifiers.v1.interception import server as interception

    original = clients.resolve_client

    def resolve_client(config):
        built = original(config)
        sdk = getattr(built, "client", None)
        if isinstance(sdk, AsyncOpenAI) and str(sdk.base_url).startswith("http://"):
            timeout = sdk.timeout if isinstance(sdk.timeout, httpx.Timeout) else httpx.Timeout(None, connect=30.0)
            if request_timeout_s is not None:
                timeout = httpx.Timeout(request_timeout_s, connect=timeout.connect or 30.0)
            built.client = AsyncOpenAI(
                base_url=sdk.base_url,
                api_key=sdk.api_key,
                default_headers=dict(sdk._custom_headers) or None,
                max_retries=MODEL_CALL_RETRIES,
                http_client=httpx.AsyncClient(
                    timeout=timeout, transport=AiohttpTransport(),
                    event_hooks={"response": [TOKEN_VERSIONS.on_response]},
                ),
            )
        return built

    if not hasattr(interception, "resolve_client"):
        raise RuntimeError("verifiers' interception server no longer resolves clients by `resolve_client`")
    interception.resolve_client = resolve_client
