"""A recipe that cannot run here is refused before the checklist runs and before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_gpu_recipe_on_a_machine_without_gpus_is_refused_first(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "primerl.cli", "rl", str(REPO / "recipes" / "alphabet-sort.toml"),
         "--run-dir", str(run), "--allow-drift"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("rl: error: recipe 'alphabet-sort' needs 2 GPU(s) per node and this machine has 0;")
    assert not run.exists()
