"""`primerl launch slurm` against a real one-node Slurm cluster (munged, slurmctld, slurmd started by the fixture)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
from conftest import CHECKLIST_SKIP, RECIPE, launch_with_fault

from primerl.launch.restart import restarts_of_run
from primerl.monitor import read_metrics

pytestmark = pytest.mark.launchers


def launch_command(tmp_path: Path, *overrides: str, login: dict | None = None) -> list[str]:
    deploy = {"target": "slurm", "run_dir": str(tmp_path / "run"), "checklist_skip": CHECKLIST_SKIP,
              "slurm": {"time_limit": "00:20:00", "poll_s": 0.5}}
    if login is not None:  # submit, follow and read the log over SSH on the login host
        login = dict(login)
        deploy["known_hosts"] = login.pop("known_hosts")
        deploy["hosts"] = {"login": login}
        deploy["slurm"]["login_host"] = "login"
    (tmp_path / "slurm.toml").write_text(tomli_w.dumps({"deploy": deploy}))
    return [sys.executable, "-m", "primerl.cli", "launch", "slurm", str(RECIPE), "--deploy",
            str(tmp_path / "slurm.toml"), "--rl.max_steps=2", *overrides]


def launch(slurm, tmp_path: Path, *overrides: str, login: dict | None = None
           ) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    command = launch_command(tmp_path, *overrides, login=login)
    env = slurm.env if login is None else {k: v for k, v in slurm.env.items() if k != "SLURM_CONF"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    print(done.stdout[-6000:], done.stderr[-3000:])
    return done, run_dir


def job_id(stdout: str) -> str:
    return re.search(r"submitted job (\d+)", stdout).group(1)


def test_tiny_recipe_completes_as_a_slurm_job(slurm, tmp_path):
    done, run_dir = launch(slurm, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    job = job_id(done.stdout)
    assert f"launch: job {job} COMPLETED" in done.stdout
    assert slurm.query("sacct", "--completion", "-j", job, "-X", "-n", "-P", "-o", "JobID,State") == \
        f"{job}|COMPLETED\n"
    report = json.loads((run_dir / "checklist" / f"{slurm.node}.json").read_text())
    assert report["ok"] and {s["name"] for s in report["steps"]} >= {"python", "model", "run_dir"}
    assert sorted(int(r["step"]) for r in read_metrics(run_dir, "trainer")) == [1, 2]
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["rl"]["status"] == "completed"


def test_failing_job_submitted_on_a_login_host_exits_nonzero_with_the_log_tail(slurm, slurm_login, tmp_path):
    """Submitted over SSH on the login host (this launcher has no SLURM_CONF: every Slurm command runs there)."""
    done, run_dir = launch(slurm, tmp_path, "--rl.orchestrator.env.id=no-such-environment", login=slurm_login)
    assert done.returncode == 1
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["rl"]["status"] == "failed"
    job = job_id(done.stdout)
    assert f"launch: FAILED: job {job} ended FAILED" in done.stdout
    tail = done.stdout[done.stdout.index("launch: FAILED"):]
    assert "stage rl failed" in tail and "no-such-environment" in tail
    assert slurm.query("sacct", "--completion", "-j", job, "-X", "-n", "-P", "-o", "State") == "FAILED\n"


def test_ctrl_c_cancels_the_job(slurm, tmp_path):
    proc = subprocess.Popen(launch_command(tmp_path), env=slurm.env, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:  # the job is running once its log has its first line
        lines.append(line)
        if line.startswith("primerl: job "):
            break
    job = job_id("".join(lines))
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()
    assert proc.wait(timeout=180) == 130
    assert f"launch: interrupted; cancelled job {job} (CANCELLED)" in rest
    assert slurm.query("squeue", "-h", "-j", job) == ""


def test_a_requeued_job_resumes_the_run_and_counts_the_restart(slurm, tmp_path):
    """`scontrol requeue` after the first trained step (what a node failure or a preemption does): Slurm kills the
    job and starts it again with SLURM_RESTART_COUNT 1; it records the restart (its line, metrics.jsonl, the manifest),
    resumes the run from its checkpoint (one every step) and completes, every step trained once."""
    run_dir = tmp_path / "run"
    jobs = []

    def requeue() -> None:
        jobs.extend(slurm.query("squeue", "-h", "-o", "%i").split())
        assert len(jobs) == 1 and slurm.query("scontrol", "requeue", jobs[0]) is not None

    code, out = launch_with_fault(launch_command(tmp_path, "--rl.trainer.ckpt.interval=1"), run_dir, requeue,
                                  env=slurm.env, poll_s=0.2)
    assert code == 0, out[-3000:]
    (job,) = jobs
    assert f"primerl: job {job} requeued (restart 1); resuming the run" in out
    assert f"launch: job {job} COMPLETED" in out
    [restart] = restarts_of_run(run_dir)
    assert (restart["process"], restart["cause"], restart["host"]) == (
        f"slurm job {job}", "was requeued by Slurm (SLURM_RESTART_COUNT 1)", slurm.node)
    assert restart["resumed_from_step"] >= 1  # the first step's checkpoint at least
    assert sorted(int(r["step"]) for r in read_metrics(run_dir, "trainer")) == [1, 2]  # each step once
    rl = json.loads((run_dir / "manifest.json").read_text())["stages"]["rl"]
    assert (rl["status"], rl["restarts"]) == ("completed", 1), rl
    assert rl["restart_entries"][0]["process"] == f"slurm job {job}"
