"""Benchmark P5: seconds from launching the README's first command to its first logged step, and the checklist's time.

Each run launches `rl recipes/reverse-text.toml --no-check` (the README's first command; the checklist it runs first is
timed on its own, below) in a fresh run directory and watches the run: `seconds_to_processes_started` is when `rl`
prints its devices line (pins verified, manifest written, configs resolved; the processes start next),
`seconds_to_inference_serving` the inference server's "serving" log line, `seconds_to_orchestrator_ready` the
orchestrator's renderer loaded (rollouts start), `seconds_to_trainer_ready` the trainer waiting for its first batch,
`seconds_to_first_batch` the first orchestrator record of metrics.jsonl (rollouts/step_0 published),
`seconds_to_first_step` the first trainer record (the first step line `rl` prints). Then the run is
stopped (SIGTERM). The model is prepared (converted and cached) and its weights hashed once before the clock starts:
a warm cache, as on every run after the first. The median of `--repeats` runs is reported, each with the 1-minute load
average before it. `--checklist` also times `primerl check recipes/reverse-text.toml` (the checklist `rl` runs before
training), with each step's seconds. Prints one JSON object; `--out FILE` also writes it.

    uv run python benchmarks/startup.py [--repeats 3] [--checklist] [--out benchmarks/results/p5_startup_cpu.json]
    uv run python benchmarks/startup.py --smoke     # recipes/tiny.toml once, and its checklist's light steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

from report import add_smoke_flag, emit

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "reverse-text.toml"
SMOKE_RECIPE = REPO / "recipes" / "tiny.toml"
HEAVY_CHECKLIST_STEPS = "sft_trainer,rl_trainer,inference,rl_smoke"  # --smoke leaves these out


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


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


# Log lines that mark a process's progress to the first step: (log, text in the line, clock format of its stamp).
# The server and the orchestrator stamp local time to the millisecond, the trainer to the second (no date).
MILESTONES = {
    "inference_serving": ("inference", " INFO primerl.inference: serving ", "%Y-%m-%d %H:%M:%S,%f"),
    "orchestrator_ready": ("orchestrator", "renderer pool:", "%Y-%m-%d %H:%M:%S,%f"),  # its tokenizer loaded
    "trainer_ready": ("trainer", " INFO waiting for ", "%H:%M:%S"),  # model loaded, waiting for the first batch
}


def milestone_time(run_dir: Path, name: str, day: datetime) -> float | None:
    """When the first line of a milestone was logged (None: not logged)."""
    log, text, clock = MILESTONES[name]
    try:
        lines = (run_dir / "logs" / f"{log}.log").read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if text in line:
            stamp = line.split(" ", 2 if clock.startswith("%Y") else 1)
            stamped = datetime.strptime(" ".join(stamp[:-1]), clock)
            if not clock.startswith("%Y"):  # the launch's day, or the next one past midnight
                stamped = datetime.combine(day.date(), stamped.time())
                stamped += timedelta(days=stamped < day - timedelta(minutes=1))
            return stamped.timestamp()
    return None


def run_processes(run_dir: Path) -> list[int]:
    """Pids of the processes still running on `run_dir`'s configs (the stage launcher and the three it started)."""
    marker = f"{run_dir}/config/".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return pids


def wait_until_gone(run_dir: Path, timeout_s: float = 120.0) -> None:
    """Return once every process of the stopped run has exited. The recipe launcher exits at once on SIGTERM; its
    stage notices within a poll and stops the three processes, which can take 10+ s (a trainer inside a step, an
    orchestrator inside its start-up): the next launch would share the cores with them."""
    deadline = time.time() + timeout_s
    while pids := run_processes(run_dir):
        if time.time() > deadline:
            raise SystemExit(f"processes {pids} of {run_dir} still running {timeout_s:.0f}s after the stop")
        time.sleep(0.2)


def measure(recipe: Path, run_dir: Path, timeout_s: float) -> dict[str, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "primerl.cli", "rl", str(recipe), "--no-check", "--run-dir", str(run_dir),
               "--rl.max_steps=3"]
    load = load_average()
    started = time.time()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    launched: list[float] = []  # when `rl` printed its devices line: the three processes start next

    def follow_stdout() -> None:
        for line in proc.stdout:
            if line.startswith("rl: devices:") and not launched:
                launched.append(time.time())

    threading.Thread(target=follow_stdout, daemon=True).start()
    try:
        while "trainer" not in (firsts := first_record_times(run_dir)):
            if proc.poll() is not None:
                raise SystemExit(f"rl exited ({proc.returncode}) before its first step:\n{proc.stderr.read()}")
            if time.time() - started > timeout_s:
                raise SystemExit(f"no step logged within {timeout_s:.0f}s")
            time.sleep(0.1)
    finally:
        proc.terminate()  # SIGTERM: `rl` stops its processes (SIGINT is ignored when this runs in the background)
        proc.wait()
        wait_until_gone(run_dir)
    day = datetime.fromtimestamp(started)
    milestones = {name: milestone_time(run_dir, name, day) for name in MILESTONES}
    return {
        "seconds_to_processes_started": round(launched[0] - started, 2) if launched else None,
        **{f"seconds_to_{name}": round(at - started, 2) if at else None for name, at in milestones.items()},
        "seconds_to_first_batch": round(firsts["orchestrator"] - started, 2),
        "seconds_to_first_step": round(firsts["trainer"] - started, 2),
        "load_average_1m_before": load,
    }


def time_checklist(recipe: Path, run_dir: Path, skip: str | None = None) -> dict:
    """`primerl check` on the recipe: wall seconds and each step's status and seconds."""
    shutil.rmtree(run_dir, ignore_errors=True)
    report = run_dir / "checklist.json"
    load = load_average()
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "primerl.cli", "check", str(recipe), "--run-dir", str(run_dir),
                           "--report", str(report), *(["--skip", skip] if skip else [])], cwd=REPO,
                          capture_output=True, text=True, check=False)
    seconds = round(time.time() - started, 1)
    if proc.returncode != 0:
        raise SystemExit(f"the checklist failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    steps = json.loads(report.read_text())["steps"]
    return {"seconds": seconds, "load_average_1m_before": load, "load_average_1m_after": load_average(),
            "steps": {s["name"]: [s["status"], s["seconds"]] for s in steps}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checklist", action="store_true", help="also time the recipe's checklist (primerl check)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench-p5")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one first step")
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    recipe = SMOKE_RECIPE if args.smoke else RECIPE
    if args.smoke:
        args.repeats, args.checklist = 1, True

    from primerl.recipes import load_recipe
    from primerl.recipes.pins import PinReport, verify_model

    verify_model(load_recipe(recipe), PinReport(), lambda _: None)  # the warm cache: model converted, hash stamped
    work = args.work_dir.resolve()
    runs = []
    for i in range(args.repeats):
        runs.append(measure(recipe, work / f"run-{i}", args.timeout))
        print(f"run {i}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    command = f"rl {recipe.relative_to(REPO)} --no-check --rl.max_steps=3"
    result = {
        "benchmark": f"P5 launch of `{command}` to its first logged step, CPU",
        "seconds_to_first_step": statistics.median(r["seconds_to_first_step"] for r in runs),
        "seconds_to_first_batch": statistics.median(r["seconds_to_first_batch"] for r in runs),
        "runs": runs,
        "command": command,
    }
    if args.checklist:
        skip = HEAVY_CHECKLIST_STEPS if args.smoke else None
        result["checklist"] = time_checklist(recipe, work / "checklist", skip)
        if skip:
            result["checklist"]["skipped"] = skip.split(",")
        print(f"checklist: {json.dumps(result['checklist'])}", file=sys.stderr, flush=True)
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
