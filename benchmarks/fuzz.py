"""Bounded fuzzing of the inference server (tiny model, CPU) and of the config and recipe loaders; prints JSON.

    uv run python benchmarks/fuzz.py --requests 10000 --loader-inputs 2000 --out benchmarks/results/fuzz.json
    uv run python benchmarks/fuzz.py --smoke          # 40 requests, 5 inputs per loader

The fuzzers are the `fuzz` tests' (tests/fuzz/fuzzing.py): schemathesis from the OpenAPI schema and hypothesis bodies
for the chat, token and admin routes; hypothesis TOML documents and command lines for the loaders.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "fuzz"), str(REPO / "tests" / "inference")]

from fuzzing import (
    CONCURRENCY,
    SERVER_ARGS,
    LoaderTally,
    fuzz_config_loader,
    fuzz_recipe_loader,
    fuzz_server,
)
from report import add_smoke_flag, emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--loader-inputs", type=int, default=2_000)
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.loader_inputs = 40, 5

    from primerl.models import resolve_model

    with tempfile.TemporaryDirectory() as workdir:
        fuzzed = fuzz_server(resolve_model("tiny"), Path(workdir), args.requests)

    loaders = {}
    for name, run in (("config", lambda t: fuzz_config_loader(args.loader_inputs, t)),
                      ("recipe", lambda t: fuzz_recipe_loader(args.loader_inputs, t, REPO / "recipes" / "tiny.toml"))):
        loader_tally = LoaderTally()
        started = time.monotonic()
        run(loader_tally)
        loaders[name] = {**loader_tally.as_dict(), "seconds": round(time.monotonic() - started, 1)}

    result = {
        "benchmark": "fuzz",
        "command": " ".join(["uv run python benchmarks/fuzz.py", *sys.argv[1:]]),
        "server": {"model": "tiny", "args": list(SERVER_ARGS)},
        "http": {
            **fuzzed.tally.as_dict(),
            "concurrency": CONCURRENCY,
            "schemathesis_requests": fuzzed.schemathesis_requests,
            "hypothesis_body_requests": fuzzed.tally.requests - fuzzed.schemathesis_requests,
            "seconds": round(fuzzed.seconds, 1),
            "health_after": fuzzed.health_after,
            "tracebacks_in_server_log": fuzzed.tracebacks_in_server_log,
            "server_rss_mb_before": round(fuzzed.server_rss_mb_before, 1),
            "server_rss_mb_after": round(fuzzed.server_rss_mb_after, 1),
        },
        "loaders": loaders,
    }
    emit(result, args.out, smoke=args.smoke)


if __name__ == "__main__":
    main()
