"""What every restart drill reads back from its run directory, whichever launcher healed the run (`rl` in
tests/integration/drills.py, `launch ssh` in tests/system/ssh_drills.py): the task order, the steps being written when
the fault struck, and the figures of its row in benchmarks/results/drills.json."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from primerl.launch.restart import restarts_of_run
from primerl.monitor import read_metrics
from primerl.transport import snapshots


def tasks_per_step(run: Path) -> list[list[str]]:
    """The task ids of each published batch, step by step."""
    steps = len(list(run.glob("rollouts/step_*")))
    return [json.loads((run / "rollouts" / f"step_{k}" / "meta.json").read_text())["extra"]["tasks"]
            for k in range(steps)]


def steps_being_written(run: Path) -> list[int]:
    """Steps whose weights or checkpoint were being written (staging directories present)."""
    staged = [*run.glob("weights/.step_*.tmp-*"), *(p.parent for p in run.glob("checkpoints/step_*/trainer.tmp"))]
    return [int(re.search(r"step_(\d+)", p.name).group(1)) for p in staged]


def restart_figures(run: Path, max_steps: int, returncode: int, started_before: int,
                    uninterrupted: Path | None) -> dict[str, Any]:
    """A healed (or stopped) run's restarts, the steps it resumed from, redid and lost, duplicate records, and whether
    its task order equals the uninterrupted run's. `started_before`: the newest step trained or being written when
    the fault struck."""
    restarts = restarts_of_run(run)
    failed_at = max([started_before, *(r["failed_at_step"] for r in restarts[:1])])
    resumed_from = restarts[0]["resumed_from_step"] if restarts else None
    trainer_steps = [r["step"] for r in read_metrics(run, "trainer")]
    batch_steps = [r["step"] for r in read_metrics(run, "orchestrator")]
    finished = returncode == 0 and snapshots.is_stable(snapshots.weights_dir(run, max_steps))
    return {
        "restarts": len(restarts),
        "causes": [f"{r['process']} {r['cause']}" for r in restarts],
        "resumed_from_checkpoint": resumed_from,
        "steps_redone": max(0, failed_at - resumed_from) if resumed_from is not None else None,
        "steps_lost": len(set(range(1, max_steps + 1)) - set(trainer_steps)),
        "duplicate_trainer_records": len(trainer_steps) - len(set(trainer_steps)),
        "duplicate_batch_records": len(batch_steps) - len(set(batch_steps)),
        "task_order_equal": None if uninterrupted is None or not finished
        else tasks_per_step(run) == tasks_per_step(uninterrupted),
        "exit_code": returncode,
        "outcome": "finished" if finished else "stopped",
    }


def assert_nothing_lost(row: dict[str, Any], run: Path, uninterrupted: Path) -> None:
    """What every drill that ends in a finished run must show: the uninterrupted run's task order, no step lost or
    recorded twice, at most the one step being trained when the fault struck done again (checkpoints every step)."""
    assert row["task_order_equal"], (tasks_per_step(run), tasks_per_step(uninterrupted))
    assert row["steps_lost"] == 0 and row["duplicate_trainer_records"] == 0, row
    assert row["duplicate_batch_records"] == 0, row
    assert row["steps_redone"] <= 1, row
