"""The orchestrator's CPU cost per rollout, in its loop and in its workers: its real loop against a cheap real
server; prints JSON.

    uv run python benchmarks/orchestrator_cpu.py --workers 0,2 --steps 6 --out benchmarks/results/orchestrator_cpu.json
    uv run python benchmarks/orchestrator_cpu.py --workers 2 --profile /tmp/orchestrator.txt   # py-spy profile (raw)
    uv run python benchmarks/orchestrator_cpu.py --smoke       # one worker, one measured step of 2 groups of 2

A `primerl inference` server on the tiny model (one engine thread, 4 new tokens: cheap, so the orchestrator side is
what is measured) serves the orchestrator's own loop (`primerl.orchestrator.loop.Orchestrator`, run in this process)
once per entry of `--workers` (`orchestrator.workers`; the list is run `--rounds` times, alternating): `--warmup` +
`--steps` batches (and one more, unmeasured, that drains what is in flight) of `--tasks` reverse-text groups of `--group-size` rollouts, with the renderer client, the
token-version ledger, the health brackets, scoring, packing and writing each batch, exactly as in `rl`. No trainer
runs: the async bound is opened as far as the run is long and `batch.max_concurrent_groups` (2 x `--tasks`) keeps
about two steps in flight, as `max_async_steps = 1` does in a run; every group is used (no zero-advantage filter), so
each step has `tasks x group_size` rollouts. Figures per measured step, from the orchestrator's own metrics: CPU
milliseconds per rollout of the loop's process (`cpu_s`, all its threads: the main loop) and of its workers
(`workers_cpu_s`, reported by each worker), rollouts per second of wall time, lost rollouts (`errors`). CPU per
rollout is the figure to compare across changes: wall time depends on the load the other processes put on the
machine's cores (recorded with each run) and, with workers, on how many cores there are to run them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "inference"), str(REPO / "benchmarks")]

from report import add_smoke_flag, emit
from server_process import start_server


async def run_loop(orchestrator, profile: Path | None, warmup: int) -> None:
    """Run the orchestrator; with `profile`, py-spy records this process (and its children) from the end of the
    warm-up steps to the end of the run."""
    if profile is None:
        await orchestrator.run()
        return

    async def record_after_warmup() -> asyncio.subprocess.Process:
        while not (orchestrator.run_dir / "rollouts" / f"step_{warmup - 1}").is_dir():
            await asyncio.sleep(0.05)
        return await asyncio.create_subprocess_exec(
            "py-spy", "record", "-p", str(os.getpid()), "-r", "200", "-f", "raw", "--threads", "--subprocesses",
            "-o", str(profile), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    profiler = asyncio.create_task(record_after_warmup())
    try:
        await orchestrator.run()
    finally:
        if not profiler.done():
            profiler.cancel()
        elif profiler.exception() is None:
            profiler.result().send_signal(signal.SIGINT)  # py-spy writes its profile when interrupted
            await profiler.result().wait()


def measure(base_url: str, run_dir: Path, workers: int, args: argparse.Namespace) -> dict:
    from primerl.config.orchestrator import OrchestratorConfig
    from primerl.monitor import read_metrics
    from primerl.orchestrator.loop import Orchestrator

    steps = args.warmup + args.steps + 1  # the last step only drains what is in flight: not measured
    cfg = OrchestratorConfig(
        run_dir=run_dir, model={"name": "tiny"}, env={"id": "reverse-text"}, seed=0,
        client={"base_url": base_url, "request_timeout_s": 60, "startup_timeout_s": 60, "retry_s": 30},
        sampling={"temperature": 1.0, "max_tokens": args.max_tokens},
        batch={"tasks_per_step": args.tasks, "group_size": args.group_size, "seq_len": 512,
               "max_concurrent_groups": 2 * args.tasks},
        advantage={"drop_zero_advantage": False}, max_steps=steps, max_async_steps=steps, workers=workers,
    )
    asyncio.run(run_loop(Orchestrator(cfg), args.profile, args.warmup))
    records = read_metrics(run_dir, "orchestrator")
    totals = [0] + [r["rollouts_total"] for r in records]
    measured = [
        {"rollouts": totals[i + 1] - totals[i], "main_loop": r["cpu_s"], "workers": r["workers_cpu_s"],
         "wall_s": r["step_s"], "lost": r["errors"]}
        for i, r in enumerate(records)
    ][args.warmup:-1]
    rollouts = sum(s["rollouts"] for s in measured)

    def ms_per_rollout(part: str) -> float | None:
        if measured[0][part] is None:
            return None
        return round(1000 * sum(s[part] for s in measured) / rollouts, 2)

    main_per_step = [1000 * s["main_loop"] / s["rollouts"] for s in measured]
    return {
        "workers": workers,
        "rollouts": rollouts,
        "lost_rollouts": sum(s["lost"] for s in measured),
        "ms_per_rollout": {"main_loop": ms_per_rollout("main_loop"), "workers": ms_per_rollout("workers")},
        "main_loop_ms_per_rollout_per_step": [round(x, 2) for x in main_per_step],
        "main_loop_ms_per_rollout_median_step": round(statistics.median(main_per_step), 2),
        "rollouts_per_s": round(rollouts / sum(s["wall_s"] for s in measured), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="0,2", help="orchestrator.workers of each run, comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="times the list of --workers is run")
    parser.add_argument("--tasks", type=int, default=16, help="groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--profile", type=Path, help="write a py-spy profile (raw, collapsed stacks) of the measured steps")
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.rounds, args.tasks, args.group_size, args.steps, args.warmup = "1", 1, 2, 2, 1, 1

    from primerl.models import resolve_model

    model_dir = resolve_model("tiny")
    with tempfile.TemporaryDirectory() as workdir, start_server(
        model_dir, Path(workdir) / "server", "--threads", "1", "--max-batch-size", "128"
    ) as server:
        runs = []
        for round_ in range(args.rounds):
            for workers in [int(n) for n in args.workers.split(",")]:
                started = time.perf_counter()
                measured = measure(server.base_url, Path(workdir) / f"run_{round_}_{workers}", workers, args)
                runs.append({**measured, "run_s": round(time.perf_counter() - started, 1)})
    emit({
        "benchmark": "orchestrator_cpu",
        "env": "reverse-text",
        "tasks_per_step": args.tasks,
        "group_size": args.group_size,
        "steps": args.steps,
        "max_tokens": args.max_tokens,
        "runs": runs,
    }, args.out, smoke=args.smoke)


if __name__ == "__main__":
    main()
