"""The orchestrator's progress that survives a restart: `checkpoints/step_<k>/orchestrator/state.json`, saved every
`ckpt.interval` batches, and the progress recorded in each published batch's meta; `resume_progress` picks the newer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from primerl.transport import checkpoints
from primerl.transport import rollouts as batches

ROLE = "orchestrator"
STATE_FILE = "state.json"


@dataclass
class Progress:
    """What `--resume` restores: the next step to write, how many tasks were drawn, which of those were still in
    flight (their groups in no published batch yet: drawn again first, in order), and the running totals."""

    next_step: int = 0
    tasks_drawn: int = 0
    tasks_in_flight: list[int] = field(default_factory=list)  # draw indices (0-based)
    groups_dropped_zero_advantage: int = 0
    samples_dropped_off_policy: int = 0
    rollouts: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)  # the task sampler's state (`sampler.task_sampler`)


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / checkpoints.CHECKPOINTS_DIR / f"step_{step}" / ROLE


def saved_steps(run_dir: Path) -> list[int]:
    return checkpoints.complete_steps(run_dir, ROLE, STATE_FILE)


def save_progress(run_dir: Path, progress: Progress, keep_last: int) -> Path:
    """Write `checkpoints/step_<next_step>/orchestrator/` (temp name, then rename) and prune older ones."""
    final = checkpoint_path(run_dir, progress.next_step)
    tmp = final.with_name(ROLE + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / STATE_FILE).write_text(json.dumps(asdict(progress), indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for step in saved_steps(run_dir)[:-keep_last]:
        shutil.rmtree(checkpoint_path(run_dir, step), ignore_errors=True)
        step_dir = checkpoint_path(run_dir, step).parent
        if step_dir.is_dir() and not any(step_dir.iterdir()):
            step_dir.rmdir()
    return final


def load_progress(run_dir: Path) -> Progress | None:
    steps = saved_steps(run_dir)
    if not steps:
        return None
    return Progress(**json.loads((checkpoint_path(run_dir, steps[-1]) / STATE_FILE).read_text()))


def resume_progress(run_dir: Path) -> Progress:
    """The progress to continue from: the newest checkpoint, or the progress recorded with a batch published after it
    (a batch already on disk is never rewritten: a resumed trainer may be reading it)."""
    progress = load_progress(run_dir) or Progress()
    published = checkpoints.published_batches(run_dir)
    if published and published[-1] >= progress.next_step:
        meta = json.loads((run_dir / batches.ROLLOUTS_DIR / f"step_{published[-1]}" / batches.META_FILE).read_text())
        recorded = meta.get("extra", {}).get("progress")
        progress = Progress(**recorded) if recorded else progress
        progress.next_step = published[-1] + 1
    return progress
