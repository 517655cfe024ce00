"""Kill drills (drills.py): each process of a tiny CPU run killed at a point of the run, then `--resume`: the run
finishes every step, nothing is lost, each step's metrics appear once, at most the steps since the last checkpoint are
redone. Also: the run directory's filesystem fills up (a sized tmpfs); the inference server hangs. And auto-restart
(`rl --max-restarts`): a process killed once mid-run is healed without `--resume`; a fault on every start stops the
run after the restarts a crash loop allows, with the cause."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, processes_of_run, rl_command, wait_for
from drill_records import assert_nothing_lost
from drills import (
    DRILLS,
    EVERY_START,
    HUNG,
    MAX_STEPS,
    RESTART_DRILLS,
    run_drill,
    run_restart_drill,
    run_uninterrupted,
)

from primerl.monitor import read_metrics
from primerl.transport.checkpoints import latest_trainer_step
from primerl.transport.rollouts import read_batch

pytestmark = [pytest.mark.drills, pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


DRILLS_VAR = "PRIMERL_DRILLS"


def _skip_unless_opted_in() -> None:
    if os.environ.get(DRILLS_VAR) != "1":
        pytest.skip(f"the drills are opt-in ({DRILLS_VAR}=1 pytest -m drills; .ci/run runs them as their own group): "
                    "each runs the tiny RL run twice, about a minute each on 2 idle cores")


@pytest.fixture(autouse=True)
def _opt_in():
    _skip_unless_opted_in()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """A run of the drills' config and seed, never killed (the module's drills compare their task order with it)."""
    _skip_unless_opted_in()
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    finished = run_uninterrupted(run)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return run


@pytest.mark.parametrize("drill", DRILLS, ids=[d.name for d in DRILLS])
def test_kill_then_resume(drill, tmp_path, uninterrupted):
    row = run_drill(drill, tmp_path / "run", uninterrupted)
    assert row["outcome"] == "finished", row
    assert_nothing_lost(row, tmp_path / "run", uninterrupted)


@pytest.mark.parametrize("process", RESTART_DRILLS)
def test_restart_after_a_kill_finishes_the_run_by_itself(process, tmp_path, uninterrupted):
    row = run_restart_drill(process, tmp_path / "run", uninterrupted)
    assert row["outcome"] == "finished" and row["exit_code"] == 0, row
    assert row["restarts"] == 1 and row["causes"] == [f"{process} was killed by signal 9"], row
    assert len(row["restart_lines"]) == 1 and row["restart_lines"][0].startswith(
        f"rl: restart 1/3: {process} was killed by signal 9 at step "), row
    assert_nothing_lost(row, tmp_path / "run", uninterrupted)


def test_restart_after_a_hang_finishes_the_run_by_itself(tmp_path, uninterrupted):
    """The trainer stops (SIGSTOP: alive, silent): no metrics record comes for stall_timeout_s, the launcher stops the
    run (the stopped trainer by SIGKILL) and resumes it."""
    row = run_restart_drill(HUNG, tmp_path / "run", uninterrupted)
    assert row["outcome"] == "finished" and row["exit_code"] == 0, row
    assert row["restarts"] == 1 and row["causes"][0].startswith("the run made no progress"), row
    assert_nothing_lost(row, tmp_path / "run", uninterrupted)


def test_restart_a_fault_at_every_start_is_a_crash_loop_that_stops_with_the_cause(tmp_path):
    row = run_restart_drill(EVERY_START, tmp_path / "run", max_restarts=5)
    assert row["exit_code"] == 1 and row["outcome"] == "stopped", row
    assert row["restarts"] == 2 and row["kills"] == 3, row  # the third same failure without a new step: a loop
    assert row["stop_line"].startswith("rl: crash loop: trainer was killed by signal 9 3 times in a row without a "
                                       "new trained step"), row
    assert row["steps_lost"] == MAX_STEPS, row


def _mount_tmpfs(where, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")


def test_a_full_disk_stops_the_run_in_one_line_and_resume_works_after(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "12m")
    run = disk / "run"
    try:
        full = subprocess.run(rl_command(run, "--max_steps=200"), cwd=REPO, capture_output=True, text=True,
                              timeout=900, check=False)
        assert full.returncode == 1, full.stdout + full.stderr
        assert "no space left on the device" in full.stderr, full.stderr[-3000:]
        assert not processes_of_run(run)
        checkpoint = latest_trainer_step(run)
        assert checkpoint >= 1, full.stdout
        subprocess.run(["mount", "-o", "remount,size=200m", str(disk)], check=True)
        resumed = subprocess.run(rl_command(run, f"--max_steps={checkpoint + 2}", "--resume"), cwd=REPO,
                                 capture_output=True, text=True, timeout=900, check=False)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert f"(step {checkpoint})" in resumed.stdout
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_hung_inference_server_ends_the_run_within_the_configured_time(tmp_path):
    """The server stops answering (SIGSTOP: alive, port open, silent) mid-run: model calls time out, the orchestrator
    gives up, and `rl` exits non-zero with a message instead of waiting forever."""
    run = tmp_path / "run"
    timeouts = ("--orchestrator.client.request_timeout_s=10", "--orchestrator.client.retry_s=10")
    launcher = subprocess.Popen(rl_command(run, "--max_steps=50", *timeouts), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(read_metrics(run, "trainer")) >= 1, timeout=600, what="a trained step", proc=launcher)
        (server,) = [pid for pid, cmd in processes_of_run(run).items() if "inference.toml" in cmd]
        os.kill(server, signal.SIGSTOP)
        _, err = launcher.communicate(timeout=240)  # far above what the timeouts allow; a hang fails here
    finally:
        for pid in processes_of_run(run):
            os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == 1, err[-3000:]
    assert "orchestrator exited with code 1" in err, err[-3000:]


def test_two_fresh_runs_of_one_config_and_seed_sample_the_same_first_batch(tmp_path, uninterrupted):
    """Step 0 is sampled by the initial policy under seeds fixed by (seed, draw, rollout), and groups enter the batch
    in draw order: the same token ids, whatever order the requests reached the server in (docs/rl.md, what is
    reproducible)."""
    again = tmp_path / "again"
    finished = subprocess.run(rl_command(again, "--max_steps=1"), cwd=REPO, capture_output=True, text=True,
                              timeout=900, check=False)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    first, second = (read_batch(run / "rollouts" / "step_0") for run in (uninterrupted, again))
    assert first.meta["extra"]["tasks"] == second.meta["extra"]["tasks"]
    for name in ("input_ids", "loss_mask", "sample_index"):
        np.testing.assert_array_equal(first.arrays[name], second.arrays[name], err_msg=name)
