"""What the checklist found: one `StepResult` per step, the `ChecklistReport` of a run (its console table and its JSON
form), and `write_report`, which writes the JSON atomically (default `<run dir>/checklist.json`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from primerl.checklist.context import Status
from primerl.storage import atomic_write


@dataclass
class StepResult:
    name: str
    status: Status
    detail: str
    seconds: float


@dataclass
class ChecklistReport:
    recipe: str | None
    run_dir: str
    steps: list[StepResult]
    log_dir: str | None = None  # where the heavy steps' logs are
    seconds: float | None = None  # wall time of all the steps (less than their sum where some ran together)

    @property
    def failed(self) -> list[StepResult]:
        return [s for s in self.steps if s.status == "failed"]

    def statuses(self) -> dict[str, Status]:
        return {s.name: s.status for s in self.steps}

    def as_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "run_dir": self.run_dir, "ok": not self.failed, "log_dir": self.log_dir,
                "seconds": self.seconds, "steps": [asdict(s) for s in self.steps]}

    def table(self) -> str:
        width = max(len(s.name) for s in self.steps) if self.steps else 4
        rows = [f"{'step'.ljust(width)}  status   seconds  detail"]
        rows += [f"{s.name.ljust(width)}  {s.status.ljust(7)}  {s.seconds:7.1f}  {s.detail}" for s in self.steps]
        if self.seconds is not None:
            rows.append(f"{'all'.ljust(width)}           {self.seconds:7.1f}  wall time of the checklist")
        return "\n".join(rows)


def write_report(report: ChecklistReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(report.as_dict(), indent=2) + "\n")

