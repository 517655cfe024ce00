"""Connections between the orchestrator and inference servers survive the server closing them.

The race: an HTTP client keeps idle connections pooled for its keep-alive expiry; the server closes idle connections
after its own keep-alive. When the server's is not longer than the client's, a request can be written into a
connection the server is closing, and fails (`RemoteProtocolError`, `ReadError`). Here the server's keep-alive is cut
to 1 s and the clients pause around it between calls, as the orchestrator does between steps.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import pytest
import verifiers.v1 as vf
from renderers import DefaultRendererConfig
from server_process import RunningServer, start_server

from primerl.orchestrator.client import (
    InferencePool,
    InferenceUnavailable,
    install_model_client_transport,
    with_retries,
)
from primerl.orchestrator.verifiers_bridge import load_env, run_group, train_client

SHORT_KEEPALIVE_S = 1


@pytest.fixture(scope="module")
def short_keepalive_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(
        tiny_model_dir, tmp_path_factory.mktemp("keepalive"), "--keep-alive-s", str(SHORT_KEEPALIVE_S)
    ) as running:
        yield running


def _gaps(n: int, seed: int) -> list[float]:
    """Idle gaps that straddle the server's keep-alive (where the race lives) and pass it."""
    rng = random.Random(seed)
    return [SHORT_KEEPALIVE_S + rng.uniform(-0.08, 0.25) for _ in range(n)]


def test_pool_calls_survive_idle_gaps_at_the_servers_keepalive(short_keepalive_server: RunningServer):
    async def go() -> tuple[int, int]:
        async with InferencePool(
            [short_keepalive_server.base_url], admin_token=None, request_timeout_s=30, retry_s=30
        ) as pool:
            await pool.wait_until_serving(30)
            server = pool.servers[0]
            answered = 0
            for gap in _gaps(12, seed=1):
                await asyncio.sleep(gap)
                body = await pool.health(server)
                answered += body["status"] == "ok"
            return answered, pool.version

    answered, version = asyncio.run(go())
    assert (answered, version) == (12, 0)


class _FlakyProxy:
    """A TCP proxy on loopback in front of a real server that drops every `every`-th new connection after reading
    its first request (the request never reaches the server): what a connection closed under a client looks like."""

    def __init__(self, upstream: str, every: int):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.every = every
        self.accepted = 0
        self.dropped = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted % self.every == 0:
                self.dropped += 1
                conn.recv(65536)
                conn.close()
                continue
            upstream = socket.create_connection(self.upstream)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _rollouts_through(url: str, tiny_model_dir: Path, groups: int, primerl_transport: bool) -> tuple[int, list, bool]:
    """Run `groups` groups of 4 rollouts against `url` (in a process of its own: verifiers' renderer pools are
    process-wide and bind their locks to the first event loop that waits on them). Returns (samples, errors, every
    sample has sampled tokens)."""
    if primerl_transport:
        install_model_client_transport()
    env = load_env("reverse-text")
    tasks = iter(env.taskset)
    client = train_client(url, tiny_model_dir, DefaultRendererConfig())
    sampling = vf.SamplingConfig(temperature=1.0, max_tokens=8)

    async def go() -> list:
        samples = []
        async with env.serving(), InferencePool([url], admin_token=None, request_timeout_s=30, retry_s=30) as pool:

            async def version() -> int:
                return int((await pool.health(pool.servers[0]))["policy_version"])

            for gap in _gaps(groups, seed=2):
                samples += await run_group(
                    env, next(tasks), 4, model="tiny", client=client, sampling=sampling, current_version=version
                )
                await asyncio.sleep(gap)
        return samples

    samples = asyncio.run(go())
    errors = [s.error for s in samples if s.error is not None]
    return len(samples), errors, all(s.loss_mask and any(s.loss_mask) for s in samples if s.error is None)


def _in_own_process(*args) -> tuple[int, list, bool]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_rollouts_through, *args).result(timeout=600)


def test_rollouts_are_not_lost_when_connections_drop(short_keepalive_server: RunningServer, tiny_model_dir: Path):
    """Groups of rollouts through verifiers' renderer client, over connections of which every third is dropped and
    with idle gaps at the server's keep-alive between groups: with primerl's model-client transport every rollout
    completes; verifiers' stock client (no retries) loses rollouts on the same proxy (what the test guards)."""
    results = {}
    for primerl_transport in (True, False):
        proxy = _FlakyProxy(short_keepalive_server.base_url, every=3)
        try:
            results[primerl_transport] = _in_own_process(proxy.url, tiny_model_dir, 5, primerl_transport)
        finally:
            proxy.close()
        assert proxy.dropped >= 2, "the proxy dropped too few connections to test anything"
    count, errors, tokens = results[True]
    assert (count, errors, tokens) == (20, [], True)
    stock_count, stock_errors, _ = results[False]
    assert stock_count == 20 and stock_errors, "without retries the dropped connections should have lost rollouts"


def test_weight_update_retried_after_its_answer_was_lost_is_not_loaded_twice(
    tiny_model_dir: Path, tmp_path: Path
):
    with start_server(tiny_model_dir, tmp_path / "server") as running:

        async def go() -> tuple[int, int]:
            async with InferencePool(
                [running.base_url], admin_token=running.admin_token, request_timeout_s=60, retry_s=30
            ) as pool:
                await pool.wait_until_serving(30)
                assert await pool.update_weights(3, tiny_model_dir)
                first = pool.version
                pool.servers[0].version = 0  # as if the answer had been lost: the same request again
                assert await pool.update_weights(3, tiny_model_dir)
                return first, pool.version

        assert asyncio.run(go()) == (3, 3)
        log = running.log()
    assert log.count("as policy version 3") == 1 and "step 3 from" in log and "already live" in log


class _DroppingServer:
    """A TCP server on loopback that accepts connections and closes each one without answering, `drops` times,
    then answers every request with a fixed HTTP 200."""

    def __init__(self, drops: int):
        self.drops = drops
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        body = b'{"status":"ok","model":"m","policy_version":7,"paused":false}'
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                if self.drops > 0:
                    self.drops -= 1
                    continue
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode() + body
                )

    def close(self) -> None:
        self.sock.close()


def test_retries_ride_out_dropped_connections_and_then_name_the_server():
    dropping = _DroppingServer(drops=3)
    try:

        async def go() -> int:
            async with InferencePool([dropping.url], admin_token=None, request_timeout_s=5, retry_s=10) as pool:
                return int((await pool.health(pool.servers[0]))["policy_version"])

        assert asyncio.run(go()) == 7
        assert dropping.drops == 0

        dropping.drops = 10**6  # now it never answers

        async def gone() -> None:
            async with httpx.AsyncClient(base_url=dropping.url) as http:
                await with_retries(lambda: http.get("/health"), f"GET {dropping.url}/health", retry_s=1.0)

        with pytest.raises(InferenceUnavailable, match=rf"GET {dropping.url}/health: no answer after \d+ attempt"):
            asyncio.run(gone())
    finally:
        dropping.close()


def test_the_servers_connections_send_without_waiting_for_acks():
    """The server's listening socket leads asyncio to set TCP_NODELAY on every connection it accepts (otherwise each
    response body over a kept-alive connection waits for the client's delayed ACK)."""
    from primerl.inference.server import listen

    async def nodelay_of_an_accepted_connection() -> int:
        listener = listen("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        async with await asyncio.start_server(on_connect, sock=listener):
            _, writer = await asyncio.open_connection(*listener.getsockname())
            value = await asyncio.wait_for(accepted, timeout=30)
            writer.close()
        return value

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
