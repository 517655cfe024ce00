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


def rl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primerl.cli", "rl", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)


def test_a_mistyped_stage_option_is_blamed_on_the_command_line(tmp_path):
    run = tmp_path / "run"
    result = rl(str(REPO / "recipes" / "reverse-text.toml"), "--rl.max_stepz", "3", "--run-dir", str(run))
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == ("rl: error: --rl.max_stepz: the rl stage has no option 'max_stepz' (did you mean --rl.max_steps? "
                    "--help lists them)")
    assert not run.exists()


def test_rl_help_lists_the_options_as_a_recipe_takes_them():
    for args in (["--help"], [str(REPO / "recipes" / "reverse-text.toml"), "--help"]):
        result = rl(*args)
        assert result.returncode == 0, result.stderr
        assert "  --rl.max_steps  int" in result.stdout and "--run-dir" in result.stdout
        assert "\n  --max_steps" not in result.stdout
        assert "--rl.output_dir" not in result.stdout  # set by the runner from --run-dir
    plain = rl("@", str(REPO / "configs" / "reverse-text" / "rl.toml"), "--help")
    assert "\n  --max_steps  int" in plain.stdout
