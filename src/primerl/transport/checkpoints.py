"""Which checkpoints a run directory holds, torch-free (the launcher reads it before any process starts).

`checkpoints/step_<k>/<role>/` is complete once its `marker` file exists: `progress.json` for the trainer (DCP state
beside it), `state.json` for the orchestrator.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"
TRAINER_MARKER = ("trainer", "progress.json")
_STEP_DIR = re.compile(r"^step_(\d+)$")


def complete_steps(run_dir: str | os.PathLike, role: str, marker: str) -> list[int]:
    """Steps k whose `checkpoints/step_<k>/<role>/<marker>` exists, ascending."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = (_STEP_DIR.match(entry.name) for entry in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m and (root / m.group(0) / role / marker).is_file())


def latest_trainer_step(run_dir: str | os.PathLike) -> int:
    """The step of the newest complete trainer checkpoint; 0 when there is none (a resume starts from scratch)."""
    steps = complete_steps(run_dir, *TRAINER_MARKER)
    return steps[-1] if steps else 0
