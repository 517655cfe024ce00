"""Bounded fuzzing of the inference server (tiny model, CPU) and of the config and recipe loaders; prints JSON.

    uv run python benchmarks/fuzz.py --requests 10000 --loader-inputs 2000 --out benchmarks/results/fuzz.json

The fuzzers are the `fuzz` tests' (tests/fuzz/fuzzing.py): schemathesis from the OpenAPI schema and hypothesis bodies
for the chat, token and admin routes; hypothesis TOML documents and command lines for the loaders.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "fuzz"), str(REPO / "tests" / "inference")]

from fuzzing import (
    SERVER_ARGS,
    LoaderTally,
    Tally,
    fuzz_bodies,
    fuzz_config_loader,
    fuzz_openapi,
    fuzz_recipe_loader,
    health_after,
)
from server_process import start_server


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--loader-inputs", type=int, default=2_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from primerl.models import resolve_model

    tally = Tally()
    with tempfile.TemporaryDirectory() as workdir, start_server(resolve_model("tiny"), Path(workdir),
                                                                *SERVER_ARGS) as server:
        rss_before = _rss_mb(server.process.pid)
        started = time.monotonic()
        fuzz_openapi(server.base_url, server.admin_token, args.requests // 2, tally)
        openapi_requests = tally.requests
        fuzz_bodies(server.base_url, server.admin_token, args.requests - tally.requests, tally)
        http_s = time.monotonic() - started
        healthy = health_after(server.base_url)
        rss_after = _rss_mb(server.process.pid)
        tracebacks_in_log = server.log().count("Traceback")

    loaders = {}
    for name, run in (("config", lambda t: fuzz_config_loader(args.loader_inputs, t)),
                      ("recipe", lambda t: fuzz_recipe_loader(args.loader_inputs, t, REPO / "recipes" / "tiny.toml"))):
        loader_tally = LoaderTally()
        started = time.monotonic()
        run(loader_tally)
        loaders[name] = {**loader_tally.as_dict(), "seconds": round(time.monotonic() - started, 1)}

    result = {
        "benchmark": "fuzz",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "server": {"model": "tiny", "args": list(SERVER_ARGS)},
        "http": {
            **tally.as_dict(),
            "schemathesis_requests": openapi_requests,
            "hypothesis_body_requests": tally.requests - openapi_requests,
            "seconds": round(http_s, 1),
            "health_after": healthy,
            "tracebacks_in_server_log": tracebacks_in_log,
            "server_rss_mb_before": round(rss_before, 1),
            "server_rss_mb_after": round(rss_after, 1),
        },
        "loaders": loaders,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
