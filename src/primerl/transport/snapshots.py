"""Weight snapshots on disk: the trainer publishes `<run>/weights/step_<k>/`, inference loads it (docs/rl.md, "The
run directory").

Contract:
- `weights/step_<k>/` holds policy version k, the weights after k optimizer steps, as a Hugging Face model directory:
  `model.safetensors` (full, unsharded state dict), `config.json`, tokenizer files, `generation_config.json` when the
  source model has one. Version 0, the initial model, is not exported: inference starts from the model itself.
- A snapshot is complete when its `STABLE` marker exists. The writer builds the directory under a temporary name,
  renames it to `step_<k>`, then writes `STABLE` (itself temp + rename): a reader that sees `STABLE` sees every file.
- `STABLE` holds JSON: {"step", "written_at" (unix seconds), "num_bytes"}.
- A version published by another transfer (primerl.transport.weight_transfer) may instead hold a marker and no
  weights: `BROADCAST` (JSON: {"step", "transfer_id", "backend", "receivers", "seconds", "num_tensors", "num_bytes",
  "num_buckets", "dtypes"}), published only after every receiver confirmed it applied version k, or `SHARED` (JSON:
  {"step", "segment_id"}), the version in the trainer's shared buffer. A directory may hold both a marker and the
  full files (steps the trainer also writes in full); readers that are not that transfer's receivers load the files
  and treat a marker-only directory as "not on disk".

Torch-free, so the inference server, the orchestrator and the launcher can use the readers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from primerl.storage import atomic_write, fsync_path
from primerl.transport.checkpoints import STEP_DIR

WEIGHTS_DIR = "weights"
STABLE = "STABLE"
BROADCAST = "BROADCAST"
SHARED = "SHARED"  # a version in the trainer's shared buffer (primerl.transport.shared)
SEGMENT_JSON = "segment.json"  # weights/shared/: where the trainer's shared buffer is and how it is laid out
SEGMENT_HANDLE = "segment.pkl"
_STAGING_DIR = re.compile(r"^\.step_\d+\.tmp-\d+$")


def weights_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / WEIGHTS_DIR / f"step_{step}"


def is_stable(path: str | os.PathLike) -> bool:
    return (Path(path) / STABLE).is_file()


def stable_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps whose snapshot is complete, ascending."""
    root = Path(run_dir) / WEIGHTS_DIR
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and is_stable(entry):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_stable(run_dir: str | os.PathLike) -> tuple[int, Path] | None:
    """The newest complete snapshot as (step, path), or None."""
    steps = stable_steps(run_dir)
    return (steps[-1], weights_dir(run_dir, steps[-1])) if steps else None


def has_files(path: str | os.PathLike) -> bool:
    """Whether the snapshot holds the weights themselves (safetensors), not only a broadcast marker."""
    return any(Path(path).glob("*.safetensors"))


def marker(path: str | os.PathLike, name: str) -> dict | None:
    """The marker `name` (`BROADCAST`, `SHARED`) of snapshot `path` (its JSON), or None when it has none."""
    file = Path(path) / name
    return json.loads(file.read_text()) if file.is_file() else None


def write_marker(staged: Path, name: str, info: dict) -> None:
    """Put the marker `name` into a staging directory (before `publish`)."""
    (staged / name).write_text(json.dumps(info, sort_keys=True))


def wait_for_weights(
    run_dir: str | os.PathLike, step: int, poll_interval_s: float = 0.2, timeout_s: float | None = None
) -> Path:
    """Block until `weights/step_<step>` is STABLE and return its path; TimeoutError after `timeout_s`."""
    path = weights_dir(run_dir, step)
    start = time.monotonic()
    while not is_stable(path):
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"weights {path} not STABLE after {timeout_s:.0f}s")
        time.sleep(poll_interval_s)
    return path


def staging_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """A fresh private directory to build snapshot `step` in before `publish` renames it into place."""
    final = weights_dir(run_dir, step)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(staged: Path, run_dir: str | os.PathLike, step: int) -> Path:
    """Move a fully written staging directory to `weights/step_<step>` and mark it STABLE (last)."""
    final = weights_dir(run_dir, step)
    for f in staged.iterdir():
        fsync_path(f)
    if final.exists():  # a re-run of the same step after a resume: replace it whole
        shutil.rmtree(final)
    os.rename(staged, final)
    num_bytes = sum(f.stat().st_size for f in final.iterdir())
    atomic_write(final / STABLE, json.dumps({"step": step, "written_at": time.time(), "num_bytes": num_bytes}))
    return final


def publish_marker(run_dir: str | os.PathLike, step: int, name: str, info: dict) -> Path:
    """Publish `weights/step_<step>/` holding only the marker `name` (and `STABLE`)."""
    staged = staging_dir(run_dir, step)
    write_marker(staged, name, info)
    return publish(staged, run_dir, step)


def prune(run_dir: str | os.PathLike, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete snapshots; return the deleted steps."""
    steps = stable_steps(run_dir)
    doomed = steps[:-keep_last] if keep_last > 0 else steps
    for step in doomed:
        path = weights_dir(run_dir, step)
        (path / STABLE).unlink(missing_ok=True)  # readers stop trusting it before the files go
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_staging_leftovers(run_dir: str | os.PathLike) -> list[str]:
    """Delete the staging directories (`.step_<k>.tmp-<pid>/`) a killed writer left behind (each one a full model
    copy); return their names. Only for a writer starting up: it must be the only one writing these snapshots."""
    root = Path(run_dir) / WEIGHTS_DIR
    leftovers = sorted(e.name for e in (root.iterdir() if root.is_dir() else []) if _STAGING_DIR.match(e.name))
    for name in leftovers:
        shutil.rmtree(root / name, ignore_errors=True)
    return leftovers


def remove_after(run_dir: str | os.PathLike, step: int) -> list[int]:
    """Delete every snapshot newer than `step` (a resumed trainer will publish those steps again); return them."""
    root = Path(run_dir) / WEIGHTS_DIR
    doomed = sorted(int(m.group(1)) for e in (root.iterdir() if root.is_dir() else [])
                    if (m := STEP_DIR.match(e.name)) and int(m.group(1)) > step)
    for newer in doomed:
        path = weights_dir(run_dir, newer)
        (path / STABLE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def shared_segment_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / WEIGHTS_DIR / "shared"


def release_shared_buffer(run_dir: str | os.PathLike) -> Path | None:
    """Remove the run's shared weight buffer (primerl.transport.shared): its file in shared memory, which outlives a
    killed trainer and holds the machine's memory until removed, and the description pointing at it. A trainer calls
    it before it makes its own buffer, `rl` once its processes have stopped (here, without torch). Returns the buffer
    file it removed, if any."""
    directory = shared_segment_dir(run_dir)
    try:
        description = json.loads((directory / SEGMENT_JSON).read_text())
    except (OSError, ValueError):
        description = None
    removed = None
    if isinstance(description, dict) and description.get("kind") == "file":
        path = Path(description["path"])
        if path.name.startswith("primerl-weights-") and path.exists():
            path.unlink(missing_ok=True)
            removed = path
    for name in (SEGMENT_JSON, SEGMENT_HANDLE):
        (directory / name).unlink(missing_ok=True)
    return removed
