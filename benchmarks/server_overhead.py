"""The inference server's own CPU per sampled token on the token route, apart from the engine's: the event loop's
thread (HTTP, request handling, the engine's events, the response) against the engine thread, for one batch of
concurrent `/inference/v1/generate` requests, as the orchestrator sends them (log-probs on, eos ignored).

On a GPU the embedded engine's host work and the event loop share one interpreter lock, and vLLM's front end runs
on the same loop, so each microsecond the loop spends per token is taken from the engine's rate at large batches
(benchmarks/NOTES.md, the P1-GPU section 15: the server at batch 256 gave half the engine's tokens/s). On the CPU,
with the tiny model, the loop's share is measured directly: the CPU seconds of each thread of the server process
(/proc/PID/task/TID/stat) over the timed batches, divided by the tokens sampled.

    uv run python benchmarks/server_overhead.py --batch 256 --new-tokens 128 --repeats 3 --out FILE --label NAME
    uv run python benchmarks/server_overhead.py --smoke      # batch 8, 8 tokens, one repeat
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "inference")]

from report import add_smoke_flag, emit  # benchmarks/report.py
from server_process import start_server  # tests/inference/server_process.py

TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the main thread of `pid` (the event loop's) and of all its other threads
    together (the engine's, torch's, the logger's: Python does not name OS threads, so they are not told apart)."""
    out = {"main": 0.0, "others": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out["main" if int(task.name) == pid else "others"] += (int(fields[11]) + int(fields[12])) / TICKS
    return out


async def one_batch(base_url: str, batch: int, new_tokens: int, seed: int) -> int:
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=batch, max_keepalive_connections=batch)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        async def one() -> int:
            body = {"model": "tiny", "token_ids": [rng.randrange(3, 900) for _ in range(32)],
                    "sampling_params": {"max_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True,
                                        "logprobs": 0}}
            response = await client.post("/inference/v1/generate", json=body)
            response.raise_for_status()
            return sum(len(choice["token_ids"]) for choice in response.json()["choices"])

        return sum(await asyncio.gather(*(one() for _ in range(batch))))


def measure(args: argparse.Namespace) -> dict:
    from primerl.models import resolve_model

    model = resolve_model("tiny")
    with tempfile.TemporaryDirectory() as work, start_server(
        model, Path(work), "--max-batch-size", str(args.batch), "--threads", str(args.threads)
    ) as server:
        pid = server.process.pid
        asyncio.run(one_batch(server.base_url, args.batch, args.new_tokens, seed=0))  # warm-up
        runs = []
        for repeat in range(args.repeats):
            before, started = thread_cpu_s(pid), time.perf_counter()
            tokens = asyncio.run(one_batch(server.base_url, args.batch, args.new_tokens, seed=repeat + 1))
            wall, after = time.perf_counter() - started, thread_cpu_s(pid)
            loop, others = after["main"] - before["main"], after["others"] - before["others"]
            runs.append({"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1),
                         "loop_cpu_s": round(loop, 3), "engine_and_other_threads_cpu_s": round(others, 3),
                         "loop_us_per_token": round(1e6 * loop / tokens, 2)})
    return {
        "runs": runs,
        "loop_us_per_token": statistics.median(r["loop_us_per_token"] for r in runs),
        "tok_s": statistics.median(r["tok_s"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="concurrent requests (and the server's batch size)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed batches after one warm-up batch")
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--label", help="keep one result per label in --out (e.g. before and after a change)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.new_tokens, args.repeats = 8, 8, 1
    if min(args.batch, args.new_tokens, args.repeats, args.threads) < 1:
        parser.error("--batch, --new-tokens, --repeats and --threads must be positive")
    result = {
        "benchmark": "server_overhead",
        "settings": {"model": "tiny", "device": "cpu", "batch": args.batch, "new_tokens": args.new_tokens,
                     "prompt_tokens": 32, "repeats": args.repeats, "engine_threads": args.threads, "logprobs": 0},
        **measure(args),
    }
    emit(result, args.out, smoke=args.smoke, merge_under=args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
