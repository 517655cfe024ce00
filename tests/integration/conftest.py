"""Helpers of the integration tests: `rl` on the tiny model, run as the user runs it (a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.monitor import read_metrics

REPO = Path(__file__).resolve().parents[2]
TINY_RL = REPO / "configs" / "debug" / "tiny-rl.toml"


@pytest.fixture(autouse=True)
def _tiny_model_built(tiny_model_dir):
    """Build the tiny model once, before any timed wait starts."""


def rl_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "primerl.cli", "rl", "@", str(TINY_RL), f"--output_dir={run_dir}", *overrides]


def run_rl(run_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(rl_command(run_dir, *overrides), check=False, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def start_rl(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(rl_command(run_dir, *overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)


def records(run_dir: Path, source: str) -> list[dict]:
    return read_metrics(run_dir, source)


def batch_meta(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "rollouts" / f"step_{step}" / "meta.json").read_text())


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"rl exited ({proc.returncode}) while waiting for {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def processes_of_run(run_dir: Path) -> dict[int, str]:
    """pid -> command line of every live process whose command line names a file of `run_dir`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if str(run_dir) in cmdline and state != "Z":
            found[int(entry.name)] = cmdline
    return found
