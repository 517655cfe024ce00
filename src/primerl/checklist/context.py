"""What a checklist step is, what it sees, and how it ends.

A step is a name, a one-line summary, a time limit and a function `run(ctx) -> detail` that returns the detail of a
pass or raises `Skip` (it cannot run here; the message is the reason) or `Fail` (its check did not hold; the message
says what was found). `Context` holds what every step looks at: the recipe (if any), the run directory, where the
heavy steps' logs go, scratch space for their outputs, and facts probed once (torch and the GPUs it sees).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from primerl.launch.progress import last_line, root_cause
from primerl.recipes.schema import Recipe

Status = Literal["passed", "failed", "skipped"]
STALL_TIMEOUT_S = 300.0


class Skip(Exception):
    """Raised by a step that cannot run here; the message is the reason."""


class Fail(Exception):
    """Raised by a step whose check did not hold; the message says what was found."""


@dataclass
class Context:
    """What the steps look at: the recipe (if any), the run directory, where logs go, scratch space for the heavy
    steps' outputs, and probed facts."""

    recipe: Recipe | None
    run_dir: Path
    log_dir: Path
    work_dir: Path
    say: Callable[[str], None]
    stall_timeout_s: float = STALL_TIMEOUT_S
    stopping: threading.Event = field(default_factory=threading.Event)  # set on Ctrl-C: the steps stop their children
    peaks: dict[str, float] = field(default_factory=dict)  # peak resident bytes of a heavy step's child, by step
    _torch: dict[str, Any] | None = field(default=None, repr=False)

    def torch_facts(self) -> dict[str, Any]:
        """torch's version and the CUDA devices it sees, probed once in a subprocess (a broken install cannot take
        the checklist down with it)."""
        if self._torch is None:
            probe = (
                "import json, torch; c = torch.cuda.is_available(); n = torch.cuda.device_count() if c else 0; "
                "print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, 'gpus': "
                "[{'name': torch.cuda.get_device_name(i), 'memory_gb': "
                "round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)} for i in range(n)]}))"
            )
            self._torch = json.loads(python_child(probe, failed="import torch failed: {}"))
        return self._torch

    @property
    def gpu_count(self) -> int:
        return len(self.torch_facts()["gpus"])

    def gpu_recipe(self) -> bool:
        """The recipe trains on GPUs (it asks for some, whether or not it may also run on CPU)."""
        return self.recipe is not None and self.recipe.info.hardware.gpus_per_node > 0

    def concurrent_ok(self) -> bool:
        """Whether the concurrent steps may run together here: a CPU run on a machine without GPUs and with at least
        two cores (on a GPU, a trainer and a server that share a device would compete for its memory)."""
        if self.gpu_recipe() or (os.cpu_count() or 1) < 2:
            return False
        try:
            return self.gpu_count == 0
        except Fail:  # torch does not import: the steps fail one after the other, each with the reason
            return False

    def require_runnable_here(self) -> None:
        """Skip a heavy step for a recipe that needs GPUs this machine does not have."""
        hw = self.recipe.info.hardware if self.recipe else None
        if hw is not None and hw.needs_gpu and self.gpu_count < hw.gpus_per_node:
            raise Skip(f"the recipe needs {hw.gpus_per_node} GPU(s) per node; this machine has {self.gpu_count}")


@dataclass(frozen=True)
class Step:
    name: str
    summary: str
    timeout_s: float | None  # None: no fixed limit; the step fails when its child stops making progress
    run: Callable[[Context], str]  # returns the detail of a pass; raises Skip or Fail
    writes_logs: bool = False  # the step starts children whose logs go to the log directory
    # May run at the same time as the neighbouring steps marked so, where `Context.concurrent_ok` (each starts one
    # process of one thread on the CPU, with its own files and port).
    concurrent: bool = False

    def limit(self, stall_timeout_s: float) -> str:
        if self.timeout_s is None:
            return f"fails after {stall_timeout_s:.0f} s without progress"
        return f"timeout {self.timeout_s:.0f} s"


def python_child(code: str, *args: str, failed: str) -> str:
    """Run `code` in a child Python (what it imports cannot break the checklist's own process) and return the last
    line it printed; a non-zero exit fails the step with `failed`, its "{}" filled with the line of the child's
    stderr that says why (`primerl.launch.progress.root_cause`)."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          check=False)
    if proc.returncode != 0:
        raise Fail(failed.format(root_cause(proc.stderr)))
    return last_line(proc.stdout)
