"""The orchestrator's own CPU cost per rollout: the real rollout path against a cheap real server; prints JSON.

    uv run python benchmarks/orchestrator_cpu.py --steps 6 --out benchmarks/results/orchestrator_cpu.json
    uv run python benchmarks/orchestrator_cpu.py --profile /tmp/orchestrator.txt   # and a py-spy profile (raw)
    uv run python benchmarks/orchestrator_cpu.py --smoke                            # one step of 2 groups of 2

A `primerl inference` server on the tiny model (one engine thread, 4 new tokens: cheap, so the orchestrator side is
what is measured) serves `--steps` steps of `--tasks` reverse-text groups of `--group-size` rollouts each, run the
way the orchestrator's loop runs them: every group concurrently through `run_group` with the renderer client, the
installed model-client transport, the token-version ledger and the pool's `GET /health` brackets. Measured in this
(the orchestrator's) process after `--warmup` steps: CPU seconds per rollout (`time.process_time`, every thread of
the process, the renderer's worker threads included), rollouts per second of wall time, and lost rollouts (a sample
with an error). CPU per rollout is the figure to compare across changes: wall time depends on the load the other
processes on the machine put on its cores (the load average is recorded with each run).
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


async def drive(base_url: str, model_dir: Path, args: argparse.Namespace) -> dict:
    import verifiers.v1 as vf

    from primerl.orchestrator import rollouts as bridge
    from primerl.orchestrator.client import InferencePool, install_model_client_transport
    from primerl.orchestrator.pydantic_speedup import cache_default_factory_checks

    install_model_client_transport(60.0)
    cache_default_factory_checks()
    env = bridge.load_env("reverse-text")
    tasks = list(env.taskset)
    client = bridge.train_client(base_url, renderer_model=model_dir)
    sampling = vf.SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)
    steps: list[dict] = []
    errors: list[str] = []
    draws = 0
    async with InferencePool([base_url], admin_token=None, request_timeout_s=60.0, retry_s=30.0) as pool:
        await pool.wait_until_serving(60.0)

        async def group(draw: int) -> list:
            with pool.acquire() as server:

                async def current_version() -> int:
                    return int((await pool.health(server))["policy_version"])

                return await bridge.run_group(
                    env, tasks[draw % len(tasks)], args.group_size, model="tiny", client=client, sampling=sampling,
                    current_version=current_version,
                    seeds=[bridge.rollout_seed(0, draw, i) for i in range(args.group_size)],
                )

        async with env.serving():
            profiler = None
            for step in range(args.warmup + args.steps):
                if step == args.warmup and args.profile:
                    profiler = await asyncio.create_subprocess_exec(
                        "py-spy", "record", "-p", str(os.getpid()), "-r", "200", "-f", "raw", "--threads",
                        "-o", str(args.profile), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )
                    await asyncio.sleep(1.0)  # py-spy attaches
                cpu, wall = time.process_time(), time.perf_counter()
                groups = await asyncio.gather(*(group(draws + i) for i in range(args.tasks)))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                draws += args.tasks
                samples = [sample for samples in groups for sample in samples]
                lost = [sample.error for sample in samples if sample.error]
                if step >= args.warmup:
                    errors.extend(lost)
                    steps.append({"rollouts": len(samples), "cpu_s": cpu, "wall_s": wall, "lost": len(lost)})
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)  # py-spy writes its profile when interrupted
                await profiler.wait()
    rollouts = sum(s["rollouts"] for s in steps)
    per_rollout_ms = [1000 * s["cpu_s"] / s["rollouts"] for s in steps]
    return {
        "rollouts": rollouts,
        "lost_rollouts": len(errors),
        "lost_examples": sorted(set(errors))[:5],
        "cpu_ms_per_rollout": round(1000 * sum(s["cpu_s"] for s in steps) / rollouts, 2),
        "cpu_ms_per_rollout_per_step": [round(x, 2) for x in per_rollout_ms],
        "cpu_ms_per_rollout_median_step": round(statistics.median(per_rollout_ms), 2),
        "rollouts_per_s": round(rollouts / sum(s["wall_s"] for s in steps), 1),
        "rollouts_per_cpu_s": round(rollouts / sum(s["cpu_s"] for s in steps), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=16, help="groups per step, run concurrently")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--profile", type=Path, help="write a py-spy profile (raw, collapsed stacks) of the steps")
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.tasks, args.group_size, args.steps, args.warmup = 2, 2, 1, 0

    from primerl.models import resolve_model

    model_dir = resolve_model("tiny")
    with tempfile.TemporaryDirectory() as workdir, start_server(
        model_dir, Path(workdir), "--threads", "1", "--max-batch-size", "128"
    ) as server:
        measured = asyncio.run(drive(server.base_url, model_dir, args))
    emit({
        "benchmark": "orchestrator_cpu",
        "env": "reverse-text",
        "tasks_per_step": args.tasks,
        "group_size": args.group_size,
        "steps": args.steps,
        "max_tokens": args.max_tokens,
        **measured,
    }, args.out, smoke=args.smoke)


if __name__ == "__main__":
    main()
