"""`primerl run` / `rl` with a recipe, as a new user meets them: the checklist checks the run as the command line
changes it, `--dry-run` prints the plan, errors name where a bad value came from, `rl` alone prints its usage, a
finished run resumed has nothing to do, and Ctrl-C during the checklist is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primerl.checklist.steps import STEPS
from primerl.commands.run import run_checks
from primerl.recipes import load_recipe
from primerl.recipes.manifest import read_manifest
from primerl.recipes.plan import plan_run
from primerl.recipes.stages import with_overrides

ROOT = Path(__file__).resolve().parents[2]
TINY_RECIPE = ROOT / "recipes" / "tiny.toml"
ENVIRONMENT_STEP = [step for step in STEPS if step.name == "environment"]


def primerl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primerl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_the_checklist_checks_the_environment_with_the_command_lines_args(tmp_path):
    recipe = load_recipe(TINY_RECIPE)
    overrides = {"rl": {"orchestrator": {"env": {"args": {"reverse": "letters"}}}}}
    plan = plan_run(recipe, tmp_path / "run", overrides, progress=None)
    code = run_checks(plan, with_overrides(recipe, overrides), "primerl run", steps=ENVIRONMENT_STEP)
    assert code == 1
    report = json.loads((tmp_path / "run" / "checklist.json").read_text())
    (step,) = report["steps"]
    assert step["status"] == "failed" and "letters" in step["detail"], step
    plan = plan_run(recipe, tmp_path / "plain", progress=None)
    assert run_checks(plan, with_overrides(recipe, {}), "primerl run", steps=ENVIRONMENT_STEP) == {
        "environment": "passed"}


def test_dry_run_prints_the_resolved_plan_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = primerl("run", str(TINY_RECIPE), "--dry-run", "--rl.max_steps", "5", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "stages rl" in out and "max_steps = 5" in out and f'output_dir = "{run_dir}"' in out
    assert "[pins.model]" in out and 'source = "tiny"' in out
    assert not run_dir.exists()
    rl = primerl("rl", str(TINY_RECIPE), "--dry-run", "--run-dir", str(run_dir))
    assert rl.returncode == 0 and "max_steps = 3" in rl.stdout, rl.stderr


def test_a_bad_value_is_blamed_on_where_it_came_from(tmp_path):
    proc = primerl("run", str(TINY_RECIPE), "--rl.max_steps", "abc", "--no-check", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "'abc'" in line and "--rl.max_steps on the command line" in line and "defaults" not in line, line
    recipe = tmp_path / "bad.toml"
    recipe.write_text(TINY_RECIPE.read_text().replace("max_steps = 3", 'max_steps = "three"', 1))
    proc = primerl("run", str(recipe), "--no-check", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "'three'" in proc.stderr and "(from bad.toml [rl])" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


def test_rl_without_arguments_prints_its_usage_and_starts_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "primerl.cli", "rl"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: rl recipe.toml") and "rl @ config.toml" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_primerl_help_names_every_recipe_tool():
    proc = primerl("--help")
    (line,) = [line for line in proc.stdout.splitlines() if line.strip().startswith("recipe ")]
    assert all(tool in line for tool in ("lock", "verify", "diff")), line


def test_ctrl_c_during_the_checklist_is_one_line_and_a_second_sigterm_too(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", str(TINY_RECIPE), "--run-dir",
                             str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("[2/"):  # the torch step: a child importing torch, seconds at least
                break
        else:
            pytest.fail("".join(seen))
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(seen) + rest
    assert proc.returncode == 130, output
    assert "Traceback" not in output, output
    after = rest.strip().splitlines()
    assert sum("interrupted" in line for line in after) == 1, output
    assert sum("stopping already" in line for line in after) <= 1, output
    assert not (tmp_path / "run" / "manifest.json").exists()


@pytest.mark.integration
def test_resuming_a_finished_run_has_nothing_to_do_and_leaves_it_alone(tmp_path):
    run_dir = tmp_path / "run"
    proc = primerl("run", str(TINY_RECIPE), "--no-check", "--run-dir", str(run_dir), "--rl.max_steps", "1",
                   timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = (run_dir / "manifest.json").read_bytes()
    proc = primerl("run", str(TINY_RECIPE), "--run-dir", str(run_dir), "--rl.max_steps", "1", "--rl.resume=true")
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stderr and "1/1 step" in proc.stderr, proc.stderr
    assert "[1/" not in proc.stdout  # no checklist ran
    assert (run_dir / "manifest.json").read_bytes() == before
    assert read_manifest(run_dir)["stages"]["rl"]["status"] == "completed"
