"""Training-state checkpoints with torch distributed checkpoint (DCP), loadable at any world size.

Layout of `<run>/checkpoints/step_<k>/trainer/` (the state after k optimizer steps; resuming runs step k + 1 next):
    *.distcp, .metadata     model and optimizer state (DCP: each rank writes its shards, any world size reads them)
    progress.json           {"step", "world_size", "scheduler", "data": {...}} (written by rank 0)
    rng_rank_<r>.pt         torch RNG states of rank r (restored when the world size is unchanged)
The directory is written as `trainer.tmp` and renamed to `trainer` once every rank has finished, so a crash during a
save never leaves something that looks complete. `checkpoints/step_<k>/orchestrator/` belongs to the orchestrator.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from primerl.config.trainer import CheckpointConfig
from primerl.trainer import dist as tdist
from primerl.trainer.dist import DistInfo
from primerl.transport import checkpoints

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = checkpoints.CHECKPOINTS_DIR
ROLE, PROGRESS = checkpoints.TRAINER_MARKER


class Checkpointer:
    """Saves and restores model, optimizer, scheduler, data position and RNG under the interval / keep-last policy."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, dist: DistInfo):
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.cfg = cfg
        self.dist = dist

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}" / ROLE

    def due(self, step: int, is_last: bool) -> bool:
        """Whether to save after completing `step` optimizer steps."""
        if is_last and self.cfg.save_at_end:
            return True
        return self.cfg.interval is not None and step % self.cfg.interval == 0

    def complete_steps(self) -> list[int]:
        return checkpoints.complete_steps(self.root.parent, ROLE, PROGRESS)

    def resume_step(self) -> int | None:
        """The step to resume from per `ckpt.resume` (None: start fresh)."""
        if self.cfg.resume is None:
            return None
        steps = self.complete_steps()
        if self.cfg.resume == "latest":
            return steps[-1] if steps else None
        if self.cfg.resume not in steps:
            raise FileNotFoundError(f"no complete trainer checkpoint for step {self.cfg.resume} under {self.root}")
        return self.cfg.resume

    def save(self, step: int, model, optimizer, scheduler, data_state: dict[str, Any]) -> Path:
        final = self.path(step)
        tmp = final.with_name(ROLE + ".tmp")
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        tdist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _single_process_quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / f"rng_rank_{self.dist.rank}.pt")
        tdist.barrier()
        if self.dist.is_main:
            progress = {
                "step": step,
                "world_size": self.dist.world_size,
                "scheduler": scheduler.state_dict(),
                "data": data_state,
            }
            (tmp / PROGRESS).write_text(json.dumps(progress, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune()
        tdist.barrier()
        return final

    def load(self, step: int, model, optimizer, scheduler) -> dict[str, Any]:
        """Restore everything saved at `step`; return the progress record (its "data" entry is the data position)."""
        path = self.path(step)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        progress = json.loads((path / PROGRESS).read_text())
        scheduler.load_state_dict(progress["scheduler"])
        rng_file = path / f"rng_rank_{self.dist.rank}.pt"
        if progress["world_size"] == self.dist.world_size and rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            log.info(
                "checkpoint saved at world size %d, now %d: RNG states not restored",
                progress["world_size"],
                self.dist.world_size,
            )
        return progress

    def _prune(self) -> None:
        if self.cfg.keep_last is None:
            return
        for step in self.complete_steps()[: -self.cfg.keep_last]:
            shutil.rmtree(self.path(step), ignore_errors=True)
            step_dir = self.path(step).parent
            if step_dir.is_dir() and not any(step_dir.iterdir()):
                step_dir.rmdir()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it 'assumes' single-process mode when no process group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
