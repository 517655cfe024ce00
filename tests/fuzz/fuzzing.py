"""Bounded fuzzing of the inference server and the config and recipe loaders, shared by the `fuzz` tests and
`benchmarks/fuzz.py` (which records the figures).

HTTP: schemathesis generates requests from the server's own OpenAPI schema (valid and invalid ones) for every
operation, and hypothesis generates bodies for the chat, token and admin routes: any JSON value, and valid bodies with
one field replaced by any JSON value. Every response must be below 500; a status the schema does not document counts
as a conformance failure. Requests go out from a few threads over kept-alive connections while hypothesis draws the
next ones (drawing is most of the client's time; the server batches what arrives together).

Loaders: hypothesis writes TOML documents and command lines from the config keys and a pool of odd values; loading
them may succeed or raise the loader's one-line error (ConfigError, RecipeError), never anything else.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import tomli_w
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from load import memory_mb
from server_process import start_server

# a server that answers fast: short context (completions end quickly), small n; one intra-op thread (the tiny model
# gains nothing from more, and on a busy machine each extra thread makes every matmul wait for a CPU)
SERVER_ARGS = ("--max-model-len", "128", "--max-n", "4", "--max-batch-size", "64", "--threads", "1")
MODEL = "tiny"
TRIVIAL_EXAMPLES = 5  # requests for an operation without a body: hypothesis soon runs out of distinct ones
CONCURRENCY = 8  # requests in flight while hypothesis draws the next ones


@dataclass
class Tally:
    """What a batch of fuzzed requests got back (recorded from the sending threads)."""

    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # status >= 500 or a dropped connection
    conformance_failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, label: str, status: int | None, detail: str = "", documented: set[int] | None = None) -> None:
        """One answer; with `documented`, a status outside it is a conformance failure."""
        with self.lock:
            self.requests += 1
            self.statuses[str(status)] += 1
            if status is None or status >= 500:
                self.server_errors.append(f"{label}: {status} {detail[:300]}")
            elif documented is not None and status not in documented:
                self.conformance_failures.append(f"{label}: undocumented {status}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "statuses": dict(sorted(self.statuses.items())),
            "responses_5xx_or_dropped": len(self.server_errors),
            "conformance_failures": len(self.conformance_failures),
            "examples": (self.server_errors + self.conformance_failures)[:10],
        }


class Sender:
    """Sends requests from `concurrency` threads over kept-alive connections to one server while the caller (hypothesis)
    draws the next ones; at most twice `concurrency` wait. Leaving the `with` block waits for all of them and raises
    what a sending thread raised."""

    def __init__(self, base_url: str, concurrency: int = CONCURRENCY) -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.Client(base_url=base_url, timeout=60, limits=limits)
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="fuzz-send")
        self.slots = threading.BoundedSemaphore(2 * concurrency)
        self.futures: list[Future[None]] = []

    def submit(self, send: Callable[[httpx.Client], None]) -> None:
        self.slots.acquire()
        self.futures.append(self.pool.submit(self._run, send))

    def _run(self, send: Callable[[httpx.Client], None]) -> None:
        try:
            send(self.http)
        finally:
            self.slots.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True)
        self.http.close()
        for future in self.futures:
            future.result()


def drive(strategy: st.SearchStrategy, examples: int, check: Callable[[Any], None]) -> None:
    """Run `check` on `examples` values hypothesis draws from `strategy` (no shrinking, no example database)."""

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(value: Any) -> None:
        check(value)

    one()


# ---------------------------------------------------------------------------------------------------------------------
# HTTP


@dataclass
class ServerFuzz:
    """What fuzzing one server process found."""

    tally: Tally
    schemathesis_requests: int
    seconds: float
    health_after: bool
    tracebacks_in_server_log: int
    server_rss_mb_before: float
    server_rss_mb_after: float


def fuzz_server(model_dir: Path, workdir: Path, requests: int) -> ServerFuzz:
    """`requests` fuzzed requests to one real server process on the tiny model: half from schemathesis, the rest
    hypothesis bodies; then whether /health still answers and what the server logged."""
    tally = Tally()
    with start_server(model_dir, workdir, *SERVER_ARGS) as server:
        rss_before = memory_mb(server.process.pid, "VmRSS")
        started = time.monotonic()
        fuzz_openapi(server.base_url, server.admin_token, requests // 2, tally)
        schemathesis_requests = tally.requests
        fuzz_bodies(server.base_url, server.admin_token, requests - tally.requests, tally)
        seconds = time.monotonic() - started
        healthy = health_after(server.base_url)
        return ServerFuzz(tally, schemathesis_requests, seconds, healthy, server.log().count("Traceback"),
                          rss_before, memory_mb(server.process.pid, "VmRSS"))


def fuzz_openapi(base_url: str, admin_token: str, budget: int, tally: Tally) -> None:
    """schemathesis over every operation of the server's schema, valid and invalid requests; admin operations both
    without and with the token (pause and resume only without: a paused engine would hold every later request)."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    runs = []
    for op in operations:
        has_body = "requestBody" in op.definition.raw  # nothing to make invalid otherwise
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[: 2 if has_body else 1]:
            runs.append((op, mode, {}))
            if op.path == "/admin/update_weights":
                runs.append((op, mode, {"Authorization": f"Bearer {admin_token}"}))
    trivial = [r for r in runs if "requestBody" not in r[0].definition.raw]  # few distinct requests to make
    per_run = max(1, (budget - TRIVIAL_EXAMPLES * len(trivial)) // (len(runs) - len(trivial)))
    with Sender(base_url) as sender:
        for op, mode, headers in runs:
            label = f"{op.method.upper()} {op.path} {mode.value}{' +token' if headers else ''}"
            documented = _documented(op)

            def send(http: httpx.Client, kwargs: dict, label: str = label, documented: set = documented) -> None:
                try:
                    response = http.request(kwargs["method"], kwargs["url"], **_httpx_kwargs(kwargs))
                except httpx.TransportError as e:
                    tally.record(label, None, repr(e))
                    return
                tally.record(label, response.status_code, response.text, documented)

            def submit(case: Any, headers: dict = headers, send: Callable = send) -> None:
                kwargs = case.as_transport_kwargs(base_url=base_url)
                kwargs["headers"] = {**(kwargs.get("headers") or {}), **headers}
                sender.submit(lambda http: send(http, kwargs))

            examples = TRIVIAL_EXAMPLES if (op, mode, headers) in trivial else per_run
            drive(op.as_strategy(generation_mode=mode), examples, submit)


def _httpx_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """schemathesis' transport kwargs (requests' names) as httpx takes them."""
    out = {k: v for k, v in kwargs.items() if k in ("headers", "params")}
    if "json" in kwargs:
        out["content"] = json.dumps(kwargs["json"]).encode()
        out["headers"] = {**out.get("headers", {}), "Content-Type": "application/json"}
    elif "data" in kwargs:
        out["content"] = kwargs["data"] if isinstance(kwargs["data"], bytes | str) else json.dumps(kwargs["data"])
    return out


def _documented(op: Any) -> set[int]:
    return {int(code) for code in op.definition.raw.get("responses", {}) if code.isdigit()}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=12,
)

GOOD_BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/inference/v1/generate": {"model": MODEL, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}},
    "/admin/update_weights": {"path": "/no/such/weights", "step": 1},
}


def _mutated(route: str) -> st.SearchStrategy:
    """A valid body of `route` with one field (top level or sampling) replaced by any JSON value, or dropped."""
    good = GOOD_BODIES[route]
    keys = sorted({*good, "n", "temperature", "top_p", "top_k", "stop", "seed", "stream", "logprobs", "tools",
                   "request_id", "max_completion_tokens", "top_logprobs", "stream_options", "tool_choice"})

    def mutate(key: str, value: Any, drop: bool) -> dict:
        body = json.loads(json.dumps(good))
        if drop:
            body.pop(key, None)
        else:
            body[key] = value
        return body

    return st.builds(mutate, st.sampled_from(keys), JSON, st.booleans())


def fuzz_bodies(base_url: str, admin_token: str, budget: int, tally: Tally) -> None:
    """hypothesis bodies for the chat, token and admin routes: any JSON, any bytes, and mutated valid bodies."""
    routes = list(GOOD_BODIES)
    per_route = max(1, budget // len(routes))
    last_route_extra = max(0, budget - per_route * len(routes))  # so the budget is met exactly
    raw = st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode())
    with Sender(base_url) as sender:
        for route in routes:
            headers = {"Content-Type": "application/json"}
            if route.startswith("/admin/"):
                headers["Authorization"] = f"Bearer {admin_token}"
            label = f"POST {route} (hypothesis)"

            def send(http: httpx.Client, body: bytes, stream: bool, route: str = route, headers: dict = headers,
                     label: str = label) -> None:
                try:
                    if stream and route == "/v1/chat/completions":
                        with http.stream("POST", route, content=body, headers=headers) as response:
                            text = "".join(response.iter_text())
                            # an error after the status line arrives in-band, as OpenAI's clients expect
                            status = 500 if '"server_error"' in text else response.status_code
                    else:
                        response = http.post(route, content=body, headers=headers)
                        status, text = response.status_code, response.text
                except httpx.TransportError as e:
                    tally.record(label, None, repr(e))
                    return
                tally.record(label, status, text)

            def submit(drawn: tuple[bytes, bool], send: Callable = send) -> None:
                sender.submit(lambda http: send(http, *drawn))

            bodies = raw | _mutated(route).map(lambda b: json.dumps(b).encode())
            examples = per_route + (last_route_extra if route == routes[-1] else 0)
            drive(st.tuples(bodies, st.booleans()), examples, submit)


def health_after(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------------------------------------------------------------
# Loaders


ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=8), st.integers(),
                                                                              max_size=3),
    st.sampled_from(["", "-1", "0", "1e999", "nan", "latest", "cuda", "broadcast", "../..", "@", "true", "null"]),
)


@dataclass
class LoaderTally:
    documents: int = 0
    accepted: int = 0
    refused_in_one_line: int = 0
    tracebacks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"inputs": self.documents, "accepted": self.accepted, "refused_in_one_line": self.refused_in_one_line,
                "tracebacks": len(self.tracebacks), "examples": self.tracebacks[:5]}


def _leaf_keys(model: Any, prefix: str = "") -> list[str]:
    import pydantic

    keys = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
            keys += _leaf_keys(ann, f"{prefix}{name}.")
        keys.append(prefix + name)
    return keys


def _nest(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in pairs:
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            existing = node.get(part)
            node = node.setdefault(part, {}) if isinstance(existing, dict) or existing is None else {}
        node[leaf] = value
    return out


def _attempt(tally: LoaderTally, expected: tuple[type[BaseException], ...], load: Callable[[], Any]) -> None:
    tally.documents += 1
    try:
        load()
        tally.accepted += 1
    except expected as e:
        message = str(e)
        if "Traceback" in message:
            tally.tracebacks.append(message[:500])
        else:
            tally.refused_in_one_line += 1
    except Exception:  # noqa: BLE001 - exactly what this fuzzer looks for
        tally.tracebacks.append(traceback.format_exc()[-800:])


def fuzz_config_loader(budget: int, tally: LoaderTally) -> None:
    """RLConfig from generated TOML files and command lines (`rl @ file --a.b=value`)."""
    from primerl.config import ConfigError, load
    from primerl.config.rl import RLConfig

    keys = _leaf_keys(RLConfig) + ["nonsense", "model.nonsense", "a.b.c"]
    pairs = st.lists(st.tuples(st.sampled_from(keys), ODD_VALUES), max_size=6)
    flags = st.lists(st.tuples(st.sampled_from(keys), st.text(max_size=12)), max_size=4)
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-config-"))

    def one(drawn: tuple) -> None:
        file_pairs, flag_pairs, raw, text = drawn
        path = workdir / "config.toml"
        try:
            path.write_text(text if raw else tomli_w.dumps(_nest([(k, v) for k, v in file_pairs if v is not None])))
        except (TypeError, ValueError, OverflowError):  # not representable in TOML: write the raw text instead
            path.write_text(text)
        argv = ["@", str(path)] + [f"--{key}={value}" for key, value in flag_pairs]
        _attempt(tally, (ConfigError,), lambda: load(RLConfig, argv))

    drive(st.tuples(pairs, flags, st.booleans(), st.text(max_size=200)), budget, one)


def fuzz_recipe_loader(budget: int, tally: LoaderTally, base_recipe: Path) -> None:
    """Recipes: `base_recipe` (one without includes) with keys replaced by odd values or dropped, or random text."""
    import tomllib

    from primerl.recipes.schema import RecipeError
    from primerl.recipes.stages import load_recipe

    base = tomllib.loads(base_recipe.read_text())
    keys = _dotted_keys(base) + ["recipe.hardware.gpus_per_node", "rl.max_steps", "pins.nonsense"]
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-recipe-"))

    def one(drawn: tuple) -> None:
        changes, raw, text = drawn
        doc = json.loads(json.dumps(base))
        for dotted, value in changes:
            node = doc
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
            if value is None:
                node.pop(leaf, None)
            else:
                node[leaf] = value
        path = workdir / "recipe.toml"
        try:
            path.write_text(text if raw else tomli_w.dumps(doc))
        except (TypeError, ValueError, OverflowError):
            path.write_text(text)
        _attempt(tally, (RecipeError,), lambda: load_recipe(path))

    changes = st.lists(st.tuples(st.sampled_from(keys), ODD_VALUES), max_size=3)
    drive(st.tuples(changes, st.booleans(), st.text(max_size=200)), budget, one)


def _dotted_keys(table: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in table.items():
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys

