"""Benchmark P5: seconds from launching `rl` on the CPU demo config to its first logged step.

Launches `rl @ configs/reverse-text/rl.toml` (SmolLM2-135M-Instruct itself, so no SFT stage is needed) in a fresh run
directory and watches its metrics.jsonl: `seconds_to_first_batch` is the first orchestrator record (rollouts/step_0
published), `seconds_to_first_step` the first trainer record (the first line `rl` prints). Then the run is stopped
with SIGINT. The model is prepared (converted and cached) before the clock starts; the median of `--repeats` runs is
reported. Prints one JSON object; `--out FILE` also writes it.

    uv run python benchmarks/startup.py [--repeats 3] [--out benchmarks/results/p5_startup_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "reverse-text" / "rl.toml"


def first_record_times(run_dir: Path) -> dict[str, float]:
    """Time of the first record of each source in the run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    firsts: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            firsts.setdefault(record["source"], record["time"])
    return firsts


def measure(run_dir: Path, model: str, timeout_s: float) -> dict[str, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "primerl.cli", "rl", "@", str(CONFIG), f"--output_dir={run_dir}",
               f"--model.name={model}", "--max_steps=3"]
    started = time.time()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while "trainer" not in (firsts := first_record_times(run_dir)):
            if proc.poll() is not None:
                raise SystemExit(f"rl exited ({proc.returncode}) before its first step:\n{proc.stderr.read()}")
            if time.time() - started > timeout_s:
                raise SystemExit(f"no step logged within {timeout_s:.0f}s")
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait()
    return {
        "seconds_to_first_batch": round(firsts["orchestrator"] - started, 2),
        "seconds_to_first_step": round(firsts["trainer"] - started, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench-p5")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one first step")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from primerl.models import resolve_model

    resolve_model(args.model)  # one-time conversion is not part of the start-up being measured
    runs = []
    for i in range(args.repeats):
        runs.append(measure(args.work_dir.resolve() / f"run-{i}", args.model, args.timeout))
        print(f"run {i}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    result = {
        "benchmark": "P5 rl launch to first logged step, CPU demo config",
        "seconds_to_first_step": statistics.median(r["seconds_to_first_step"] for r in runs),
        "seconds_to_first_batch": statistics.median(r["seconds_to_first_batch"] for r in runs),
        "runs": runs,
        "config": {"file": str(CONFIG.relative_to(REPO)), "model": args.model},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_1m": round(os.getloadavg()[0], 2)},
    }
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
