"""Soak: a long RL run, every process watched, to show that nothing grows step after step.

Runs `rl recipes/tiny.toml --no-check` for `--steps` steps (default 1,000) and, with `--demo`, `rl
recipes/reverse-text.toml --no-check` for `--demo-steps` (default 200), each with a trainer checkpoint every
`--ckpt-interval` steps (so rollout batches can be pruned, `trainer.ckpt.keep_rollouts`). Every `--interval-s` seconds it
samples each process of the run (the launcher, inference, orchestrator, trainer: RSS, PSS, USS and anonymous memory
from /proc/<pid>/smaps_rollup, open files, threads), the run directory's size and file count, and the trainer's step
(from metrics.jsonl). After the warm-up (`--warm-up` of the steps, default the first 20 %) it fits a line to each
process's memory over the step and reports the growth in MB per 100 steps (least squares; `_median`: Theil-Sen, which
a checkpoint's short spike does not tilt); the run directory likewise. The target (issue 34): no process grows more
than 1 MB per 100 steps after warm-up (`over_target`: least-squares PSS), and the run directory stays bounded.

    uv run python benchmarks/soak.py --out benchmarks/results/soak_cpu.json [--demo]
    uv run python benchmarks/soak.py --only demo --set rl.trainer.train.backward_dtype=float32 \
        --out benchmarks/results/soak_cpu.json     # the demo alone; the file's other runs are kept

Each run records the load average (1 min) seen while it ran, and the commit it measured: on a shared machine the step
time follows the load, the growth per step should not.
    uv run python benchmarks/soak.py --smoke          # the tiny recipe, 12 steps, sampled every second
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from procs import median_slope, sample_tree, slope, tree_size  # benchmarks/procs.py
from report import add_smoke_flag, commit, emit, not_run  # benchmarks/report.py

REPO = Path(__file__).resolve().parents[1]
TARGET_MB_PER_100_STEPS = 1.0


class StepCounter:
    """The trainer's newest step in `<run>/metrics.jsonl`, read incrementally."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.offset = 0
        self.step = 0

    def read(self) -> int:
        if not self.path.is_file():
            return self.step
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("source") == "trainer":
                self.step = max(self.step, int(record["step"]))
        return self.step


def soak(recipe: str, steps: int, work: Path, interval_s: float, ckpt_interval: int, warm_up: float,
         extra: list[str]) -> dict[str, Any]:
    run_dir = work / Path(recipe).stem
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "primerl.cli", "rl", recipe, "--no-check", "--run-dir", str(run_dir),
               f"--rl.max_steps={steps}", f"--rl.trainer.ckpt.interval={ckpt_interval}", *extra]
    log_path = work / f"{Path(recipe).stem}.console.log"
    samples: list[dict[str, Any]] = []
    counter = StepCounter(run_dir)
    started = time.time()
    with open(log_path, "w") as log, subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT) as proc:
        stop = threading.Event()
        while proc.poll() is None:
            step = counter.read()
            procs = sample_tree(proc.pid)
            size_mb, files = tree_size(run_dir) if run_dir.is_dir() else (0.0, 0)
            samples.append({"t": round(time.time() - started, 1), "step": step, "run_dir_mb": round(size_mb, 2),
                            "run_dir_files": files, "load_1m": round(os.getloadavg()[0], 2),
                            "procs": {r: {k: round(v, 2) for k, v in f.items()} for r, f in procs.items()}})
            print(f"[{samples[-1]['t']:7.1f}s] step {step}/{steps} " + " ".join(
                f"{r} {f['pss_mb']:.0f}MB" for r, f in sorted(procs.items())) + f" run {size_mb:.1f}MB/{files}",
                file=sys.stderr, flush=True)
            stop.wait(interval_s)
    wall = time.time() - started
    completed = counter.read()
    if proc.returncode != 0:
        tail = log_path.read_text().splitlines()[-20:]
        raise SystemExit(f"rl {recipe} exited {proc.returncode} after {completed} steps:\n" + "\n".join(tail))
    shown = " ".join(command[2:]).replace(str(run_dir), f"<work>/{run_dir.name}")  # no path of this machine
    return {**summarize(recipe, steps, completed, wall, samples, warm_up, shown),
            "heap_trim": trim_cost(run_dir / "metrics.jsonl", max(1, int(warm_up * steps)))}


def trim_cost(metrics: Path, after_step: int) -> dict[str, Any] | None:
    """What the trainer's heap check and trim (`heap_trim_s`, after each step) cost against its steps (`step_s`),
    over the steps after `after_step`, and where the trim fired (`heap_trimmed_gb`); None where no step logged it."""
    rows = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("source") == "trainer" and "heap_trim_s" in record:
                rows.append(record)
    late = sorted((r for r in rows if r["step"] > after_step), key=lambda r: r["step"])
    if not late:
        return None
    checks = sorted(r["heap_trim_s"] for r in late)
    return {
        "steps": len(late),
        "median_ms": round(checks[len(checks) // 2] * 1e3, 2),
        "mean_ms": round(sum(checks) / len(checks) * 1e3, 2),
        "max_ms": round(checks[-1] * 1e3, 1),
        "share_of_step_s_pct": round(100 * sum(checks) / sum(r["step_s"] for r in late), 3),
        "median_step_s": round(sorted(r["step_s"] for r in late)[len(late) // 2], 3),
        "fired": [[r["step"], round(r["heap_trimmed_gb"], 3), round(r["heap_trim_s"], 3)]
                  for r in sorted(rows, key=lambda r: r["step"]) if "heap_trimmed_gb" in r],
    }


def summarize(recipe: str, steps: int, completed: int, wall: float, samples: list[dict[str, Any]], warm_up: float,
              command: str) -> dict[str, Any]:
    after = [s for s in samples if s["step"] >= max(1, int(warm_up * steps)) and s["step"] < steps]
    roles = sorted({r for s in samples for r in s["procs"]})
    per_process = {}
    for role in roles:
        seen = [s for s in samples if role in s["procs"]]
        late = [s for s in after if role in s["procs"]]
        xs = [s["step"] for s in late]

        def growth(key: str, late=late, xs=xs, role=role, fit=slope) -> float | None:
            if not all(key in s["procs"][role] for s in late):
                return None
            fitted = fit(xs, [s["procs"][role][key] for s in late])
            return None if fitted is None else round(fitted * 100, 3)

        per_process[role] = {
            "pss_mb_per_100_steps": growth("pss_mb"),
            "rss_mb_per_100_steps": growth("rss_mb"),
            "uss_mb_per_100_steps": growth("uss_mb"),
            "anon_mb_per_100_steps": growth("anon_mb"),
            "pss_mb_per_100_steps_median": growth("pss_mb", fit=median_slope),
            "uss_mb_per_100_steps_median": growth("uss_mb", fit=median_slope),
            "fds_per_100_steps": growth("fds"),
            "threads_per_100_steps": growth("threads"),
            "peak_pss_mb": max(s["procs"][role]["pss_mb"] for s in seen),
            "peak_rss_mb": max(s["procs"][role]["rss_mb"] for s in seen),
            "peak_uss_mb": max(s["procs"][role].get("uss_mb", 0.0) for s in seen),
            "pss_mb_after_warm_up": [late[0]["procs"][role]["pss_mb"], late[-1]["procs"][role]["pss_mb"]] if late
            else None,
            "fds_max": max(s["procs"][role]["fds"] for s in seen),
            "threads_max": max(s["procs"][role]["threads"] for s in seen),
        }
    xs = [s["step"] for s in after]
    run_slope = slope(xs, [s["run_dir_mb"] for s in after])
    files_slope = slope(xs, [s["run_dir_files"] for s in after])
    growing = {r: p["pss_mb_per_100_steps"] for r, p in per_process.items()
               if p["pss_mb_per_100_steps"] is not None and p["pss_mb_per_100_steps"] > TARGET_MB_PER_100_STEPS}
    every = max(1, len(samples) // 60)
    return {
        "recipe": recipe,
        "command": command,
        "steps_requested": steps,
        "steps_completed": completed,
        "wall_s": round(wall, 1),
        "warm_up_steps": max(1, int(warm_up * steps)),
        "samples": len(samples),
        "load_average_1m": load_summary([s["load_1m"] for s in samples if "load_1m" in s]),
        "per_process": per_process,
        "run_dir": {
            "mb_per_100_steps_after_warm_up": None if run_slope is None else round(run_slope * 100, 3),
            "files_per_100_steps_after_warm_up": None if files_slope is None else round(files_slope * 100, 2),
            "peak_mb": max((s["run_dir_mb"] for s in samples), default=0.0),
            "peak_files": max((s["run_dir_files"] for s in samples), default=0),
            "over_time": [[s["t"], s["step"], s["run_dir_mb"], s["run_dir_files"]] for s in samples[::every]],
        },
        "pss_over_time": [[s["t"], s["step"], {r: f["pss_mb"] for r, f in s["procs"].items()}]
                          for s in samples[::every]],
        "target_mb_per_100_steps": TARGET_MB_PER_100_STEPS,
        "over_target": growing,
    }


def load_summary(loads: list[float]) -> dict[str, float] | None:
    """min, mean and max of the 1-minute load average over a run's samples."""
    if not loads:
        return None
    return {"min": min(loads), "mean": round(sum(loads) / len(loads), 2), "max": max(loads)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps of the tiny recipe")
    parser.add_argument("--demo", action="store_true", help="also soak recipes/reverse-text.toml")
    parser.add_argument("--demo-steps", type=int, default=200)
    parser.add_argument("--interval-s", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--ckpt-interval", type=int, default=100, help="trainer checkpoint every this many steps")
    parser.add_argument("--warm-up", type=float, default=0.2, help="fraction of the steps left out of the fit")
    parser.add_argument("--work-dir", type=Path, help="where the runs go (default: a temporary directory, removed)")
    parser.add_argument("--only", choices=("tiny", "demo"),
                        help="run this recipe alone (its entry in --out is replaced, the others kept)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run's `rl` command, e.g. rl.trainer.train.backward_dtype=float32")
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.interval_s, args.ckpt_interval, args.warm_up = 12, 1.0, 3, 0.25
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="primerl-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"benchmark": "soak: per-process memory, files, threads and run directory over a long run"}
    bad = [item for item in args.set if "=" not in item or not item.split("=", 1)[0]]
    if bad:
        parser.error(f"--set takes KEY=VALUE, got {bad[0]!r}")
    extra = [f"--{item}" for item in args.set]
    wanted = [args.only] if args.only else ["tiny", *(["demo"] if args.demo else [])]
    kept = {}
    if args.out is not None and args.out.is_file() and not args.smoke:
        try:
            kept = json.loads(args.out.read_text()).get("runs", {})
        except json.JSONDecodeError as e:
            raise SystemExit(f"{args.out}: not a soak result to add to ({e})") from None
    runs = {}
    for name in wanted:
        recipe, steps = ("recipes/tiny.toml", args.steps) if name == "tiny" else ("recipes/reverse-text.toml",
                                                                                 args.demo_steps)
        measured = commit()  # the code as the run starts: the tree may move on during a long run
        runs[name] = {**soak(recipe, steps, work, args.interval_s, args.ckpt_interval, args.warm_up, extra),
                      "commit": measured}
    runs = {**{k: v for k, v in kept.items() if k not in runs}, **runs}
    result["runs"] = runs
    result["steps_completed"] = {name: run["steps_completed"] for name, run in runs.items()}
    if "demo" not in runs:
        not_run(result, "demo", "run with --demo (recipes/reverse-text.toml for --demo-steps steps)")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
