"""Kill drills on the tiny CPU run (`drills` tests, `benchmarks/drills.py`): start `rl`, SIGKILL one process at a
point of the run (writing a batch, writing weights, checkpointing, mid-run), then `rl --resume` to the end, and report
what the fault cost, and whether the resumed run trained on the same tasks in the same steps as an uninterrupted run of
the same config and seed.

The auto-restart drills (`run_restart_drill`) start `rl --max-restarts N` and SIGKILL one process once mid-run (the
launcher restarts the run by itself), or every trainer that starts (the launcher must give up with the cause)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO, processes_of_run, rl_command, wait_for
from drill_records import restart_figures, steps_being_written, tasks_per_step

from primerl.monitor import read_metrics
from primerl.transport import snapshots

MAX_STEPS = 4


@dataclass(frozen=True)
class Drill:
    process: str  # rl | inference | orchestrator | trainer
    point: str  # what the run was doing

    @property
    def name(self) -> str:
        return f"{self.process}@{self.point.replace(' ', '-')}"


def _staging(run: Path, pattern: str) -> bool:
    return any(run.glob(pattern))


# When each point is reached, seen from the run directory (polled every few milliseconds).
POINTS = {
    "writing a batch": lambda run: _staging(run, "rollouts/.step_*") or (run / "rollouts" / "step_1").is_dir(),
    "writing weights": lambda run: _staging(run, "weights/.step_*.tmp-*"),
    "checkpointing": lambda run: _staging(run, "checkpoints/step_*/trainer.tmp"),
    "mid-run": lambda run: len(read_metrics(run, "trainer")) >= 1,
}
DRILLS = [
    Drill("orchestrator", "writing a batch"),
    Drill("trainer", "writing weights"),
    Drill("trainer", "checkpointing"),
    Drill("inference", "mid-run"),
    Drill("rl", "mid-run"),
]


def _pid_of(run: Path, process: str, launcher: subprocess.Popen) -> int | None:
    if process == "rl":
        return launcher.pid
    found = [pid for pid, cmd in processes_of_run(run).items() if f"{process}.toml" in cmd]
    return min(found) if found else None


def run_uninterrupted(run: Path) -> subprocess.CompletedProcess:
    """The run every drill is compared with: the same config and seed, never killed."""
    return subprocess.run(rl_command(run, f"--max_steps={MAX_STEPS}"), cwd=REPO, capture_output=True, text=True,
                          timeout=900, check=False)


def run_drill(drill: Drill, run: Path, uninterrupted: Path | None = None) -> dict:
    """One drill; the row of the results table (with `uninterrupted`, a run of the same config and seed: whether the
    resumed run trained on the same tasks in the same steps)."""
    launcher = subprocess.Popen(rl_command(run, f"--max_steps={MAX_STEPS}"), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    reached = POINTS[drill.point]
    deadline = time.monotonic() + 600
    while not reached(run):
        assert launcher.poll() is None, f"{drill.name}: the run ended before the point was reached"
        assert time.monotonic() < deadline, f"{drill.name}: the point was never reached"
        time.sleep(0.005)
    pid = _pid_of(run, drill.process, launcher)
    os.kill(pid, signal.SIGKILL)
    trained_before = max((r["step"] for r in read_metrics(run, "trainer")), default=0)
    started_before = max([trained_before, *steps_being_written(run)])
    launcher.communicate(timeout=300)
    wait_for(lambda: not processes_of_run(run), timeout=120, what="every process of the killed run to stop")
    first_exit = launcher.returncode

    resumed = subprocess.run(rl_command(run, f"--max_steps={MAX_STEPS}", "--resume"), cwd=REPO, capture_output=True,
                             text=True, timeout=900, check=False)
    match = re.search(r"\(step (\d+)\)", resumed.stdout)
    resumed_from = int(match.group(1)) if match else 0
    trainer_steps = [r["step"] for r in read_metrics(run, "trainer")]
    batch_steps = [r["step"] for r in read_metrics(run, "orchestrator")]
    finished = resumed.returncode == 0 and snapshots.is_stable(snapshots.weights_dir(run, MAX_STEPS))
    return {
        "fault": f"SIGKILL {drill.process}",
        "point": drill.point,
        "first_run_exit": first_exit,
        "trained_before_kill": trained_before,
        "step_in_progress_at_kill": started_before if started_before > trained_before else None,
        "resumed_from_checkpoint": resumed_from,
        "steps_redone": max(0, started_before - resumed_from),
        "steps_lost": len(set(range(1, MAX_STEPS + 1)) - set(trainer_steps)),
        "duplicate_trainer_records": len(trainer_steps) - len(set(trainer_steps)),
        "duplicate_batch_records": len(batch_steps) - len(set(batch_steps)),
        "resume_exit": resumed.returncode,
        "task_order_equal": None if uninterrupted is None else tasks_per_step(run) == tasks_per_step(uninterrupted),
        "outcome": "finished" if finished else "failed",
        "resume_tail": "" if finished else (resumed.stdout + resumed.stderr)[-1500:],
    }


# ---------------------------------------------------------------------------------------------------------------------
# Auto-restart: `rl --max-restarts N` heals the run itself

RESTART_DRILLS = ["trainer", "orchestrator", "inference"]  # SIGKILLed once, mid-run
MAX_RESTARTS = 3
EVERY_START = "trainer at every start"  # the fault injected on every start: each trainer SIGKILLed as it appears
HUNG = "hung trainer"  # the trainer SIGSTOPped once mid-run: alive and silent; the launcher sees the run stall
STALL_TIMEOUT_S = 120  # the hung drill's stall_timeout_s: far above a step of the tiny run on a busy machine


def _kill_every_new(run: Path, process: str, stop: threading.Event) -> list[int]:
    """SIGKILL each `process` of the run as soon as it appears, until `stop`; returns the pids killed."""
    killed: list[int] = []

    def watch() -> None:
        while not stop.is_set():
            for pid, cmd in processes_of_run(run).items():
                if f"{process}.toml" in cmd and pid not in killed:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    except ProcessLookupError:
                        pass
            time.sleep(0.02)

    threading.Thread(target=watch, name=f"kill-every-{process}", daemon=True).start()
    return killed


def run_restart_drill(fault: str, run: Path, uninterrupted: Path | None = None,
                      max_restarts: int = MAX_RESTARTS) -> dict:
    """`rl --max-restarts` with `fault` (a process of `RESTART_DRILLS` SIGKILLed once after the first trained step,
    `HUNG` or `EVERY_START`); the row of the results table."""
    stall = [f"--stall_timeout_s={STALL_TIMEOUT_S}"] if fault == HUNG else []
    launcher = subprocess.Popen(rl_command(run, f"--max_steps={MAX_STEPS}", f"--max-restarts={max_restarts}", *stall),
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    trained_before = started_before = 0
    try:
        if fault == EVERY_START:
            killed = _kill_every_new(run, "trainer", stop)
        else:
            deadline = time.monotonic() + 600
            while not POINTS["mid-run"](run):
                assert launcher.poll() is None, f"restart {fault}: the run ended before its first trained step"
                assert time.monotonic() < deadline, f"restart {fault}: no step was trained"
                time.sleep(0.005)
            if fault == HUNG:
                os.kill(_pid_of(run, "trainer", launcher), signal.SIGSTOP)
            else:
                os.kill(_pid_of(run, fault, launcher), signal.SIGKILL)
            killed = [fault]
            trained_before = max((r["step"] for r in read_metrics(run, "trainer")), default=0)
            started_before = max([trained_before, *steps_being_written(run)])
        out, err = launcher.communicate(timeout=1800)
    finally:
        stop.set()
        if launcher.poll() is None:
            launcher.kill()
    wait_for(lambda: not processes_of_run(run), timeout=120, what="every process of the run to stop")
    figures = restart_figures(run, MAX_STEPS, launcher.returncode, started_before, uninterrupted)
    lines = err.splitlines()
    return {
        "fault": {EVERY_START: f"SIGKILL {fault}", HUNG: f"SIGSTOP trainer once, mid-run (stall_timeout_s "
                  f"{STALL_TIMEOUT_S})"}.get(fault, f"SIGKILL {fault} once, mid-run"),
        "max_restarts": max_restarts,
        "kills": len(killed),
        "trained_before_kill": trained_before if fault != EVERY_START else None,
        **figures,
        "restart_lines": [line for line in lines if line.startswith("rl: restart ")],
        "stop_line": next((line for line in lines if line.startswith("rl: crash loop") or "restart(s) used" in line),
                          None),
        "tail": "" if figures["outcome"] == "finished" or fault == EVERY_START else (out + err)[-1500:],
    }
