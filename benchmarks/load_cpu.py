"""Concurrent streaming chat requests against the embedded engine on the CPU (tiny model); prints JSON.

    uv run python benchmarks/load_cpu.py --streams 256 --admit 64 --max-tokens 16 --memory-bound-mb 4096 \
        --out benchmarks/results/load_cpu.json
    uv run python benchmarks/load_cpu.py --smoke      # 8 streams, 4 admitted, 4 tokens each

Every request must stream to `[DONE]` or be refused at once with 429/503 by the admission limit
(`max_concurrent_requests`); the server's peak resident memory must stay under the bound. Latencies are per request,
from sending it to its first event and to its end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "fuzz"), str(REPO / "tests" / "inference")]

from load import memory_mb, stream_storm
from report import add_smoke_flag, emit
from server_process import start_server


def percentiles(values: list[float]) -> dict[str, float] | None:
    if len(values) < 2:
        return None
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(cuts[49], 3), "p90": round(cuts[89], 3), "p99": round(cuts[98], 3),
            "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--admit", type=int, default=64, help="the server's max_concurrent_requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--memory-bound-mb", type=float, default=4096)
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.streams, args.admit, args.max_tokens, args.max_batch_size = 8, 4, 4, 4

    from primerl.models import resolve_model

    server_args = ("--max-concurrent-requests", str(args.admit), "--max-batch-size", str(args.max_batch_size))
    with tempfile.TemporaryDirectory() as workdir, start_server(resolve_model("tiny"), Path(workdir),
                                                                *server_args) as server:
        started = time.monotonic()
        outcomes = stream_storm(server.base_url, args.streams, args.max_tokens)
        wall_s = time.monotonic() - started
        peak = memory_mb(server.process.pid, "VmHWM")
    statuses = Counter(str(o.status) for o in outcomes)
    completed = [o for o in outcomes if o.completed]
    refused = [o for o in outcomes if o.status in (429, 503)]
    other = [o for o in outcomes if not o.completed and o.status not in (429, 503)]
    result = {
        "benchmark": "load_cpu",
        "model": "tiny",
        "streams": args.streams,
        "max_concurrent_requests": args.admit,
        "max_batch_size": args.max_batch_size,
        "max_tokens": args.max_tokens,
        "statuses": dict(sorted(statuses.items())),
        "completed": len(completed),
        "refused_429_503": len(refused),
        "other_outcomes": len(other),
        "other_examples": [o.error or str(o.status) for o in other[:5]],
        "wall_s": round(wall_s, 2),
        "completed_first_event_s": percentiles([o.first_event_s for o in completed if o.first_event_s is not None]),
        "completed_total_s": percentiles([o.total_s for o in completed]),
        "refused_total_s": percentiles([o.total_s for o in refused]),
        "server_peak_rss_mb": round(peak, 1),
        "memory_bound_mb": args.memory_bound_mb,
        "ok": not other and peak < args.memory_bound_mb,
    }
    emit(result, args.out, smoke=args.smoke)
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
