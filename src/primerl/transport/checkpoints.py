"""Which checkpoints and batches a run directory holds, and which batches may go; torch-free (the launcher reads it
before any process starts).

`checkpoints/step_<k>/<role>/` is complete once its `marker` file exists: `progress.json` for the trainer (DCP state
beside it), `state.json` for the orchestrator. `rollouts/step_<n>/` is published once its meta.json exists
(`primerl.transport.rollouts`); `prune_batches` removes those no resume can read again.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from primerl.transport import rollouts

CHECKPOINTS_DIR = "checkpoints"
TRAINER_MARKER = ("trainer", "progress.json")
STEP_DIR = re.compile(r"^step_(\d+)$")  # step k's directory, in checkpoints/, rollouts/ and weights/


def complete_steps(run_dir: str | os.PathLike, role: str, marker: str) -> list[int]:
    """Steps k whose `checkpoints/step_<k>/<role>/<marker>` exists, ascending."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = (STEP_DIR.match(entry.name) for entry in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m and (root / m.group(0) / role / marker).is_file())


def latest_trainer_step(run_dir: str | os.PathLike) -> int:
    """The step of the newest complete trainer checkpoint; 0 when there is none (a resume starts from scratch)."""
    steps = complete_steps(run_dir, *TRAINER_MARKER)
    return steps[-1] if steps else 0


def published_batches(run_dir: str | os.PathLike) -> list[int]:
    """Steps n whose `rollouts/step_<n>/` is published (its meta.json present), ascending."""
    root = Path(run_dir) / rollouts.ROLLOUTS_DIR
    if not root.is_dir():
        return []
    found = (STEP_DIR.match(entry.name) for entry in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m and (root / m.group(0) / rollouts.META_FILE).is_file())


def prune_batches(run_dir: str | os.PathLike, keep_last: int | None, consumed: int, resumable: list[int]) -> list[int]:
    """Remove old batches so that a long run's `rollouts/` stays bounded; returns the steps removed.

    Only batches that nothing can read again go: below `consumed` (the trainer has trained on every batch before it)
    and below the oldest step in `resumable` (the complete trainer checkpoints: a resume from step c reads
    `rollouts/step_c` onwards, which the orchestrator never writes again). Of those, the newest `keep_last` stay for a
    person to look at. Nothing goes while no checkpoint exists (a resume would start at step 0) or with `keep_last`
    None."""
    if keep_last is None or not resumable:
        return []
    below = min(consumed, min(resumable))
    removable = [n for n in published_batches(run_dir) if n < below]
    removed = removable[:max(len(removable) - keep_last, 0)]
    for n in removed:
        path = rollouts.batch_dir(run_dir, n)
        doomed = path.with_name(f".{path.name}.pruned-{uuid.uuid4().hex[:8]}")  # never seen half removed
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed
