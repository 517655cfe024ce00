"""What a launcher checks on this machine before it starts any process: the GPUs it may hand out, and a run directory
it can write. What it finds wrong is a `LaunchError`, whose message is one line for the user.

Light on purpose (no torch, no pydantic): `rl` and `primerl run` check these before anything starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


class LaunchError(Exception):
    """A problem found before any process started; the message is one line."""


def visible_gpus() -> list[str]:
    """CUDA devices this process may hand out, as the ids to put in CUDA_VISIBLE_DEVICES (no torch import)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def require_writable(run_dir: Path) -> None:
    """Create `run_dir` and prove a file can be written there; LaunchError (one line) when not: its parent is a file,
    the filesystem is read-only or full, permissions."""
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise LaunchError(f"cannot write to the run directory {run_dir}: {e.strerror or e}") from None
