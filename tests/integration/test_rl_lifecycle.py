"""`rl` when what surrounds it fails: the process that started it is killed, the run directory cannot be written, a
resumed run finds snapshots and staging leftovers of the steps it trains again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, processes_of_run, rl_command, run_rl, wait_for

from primerl.launch.restart import forget_what_is_redone
from primerl.monitor import read_metrics
from primerl.transport import snapshots

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.mark.integration
def test_killing_what_started_rl_stops_the_whole_run(tmp_path):
    """`uv run rl ...` killed with SIGKILL (a CI cancel, `timeout -s KILL`): rl and its three children stop too."""
    run = tmp_path / "run"
    shell = subprocess.Popen(  # a parent that does not exec into rl, like `uv run`
        ["bash", "-c", " ".join(rl_command(run, "--max_steps=50")) + "; exit $?"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    wait_for(lambda: any("trainer.toml" in cmd for cmd in processes_of_run(run).values()), timeout=300,
             what="the trainer to start", proc=shell)
    shell.send_signal(signal.SIGKILL)
    shell.wait()
    try:
        wait_for(lambda: not processes_of_run(run), timeout=120,
                 what="rl and its children to stop after their starter was killed")
    finally:
        for pid in processes_of_run(run):  # what the failed test left behind
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("where", ["under a file", "read-only"])
def test_an_unwritable_run_dir_is_one_line_and_exit_2(tmp_path, where):
    if where == "under a file":
        (tmp_path / "a-file").write_text("")
        run = tmp_path / "a-file" / "run"
    else:
        run = tmp_path / "ro"
        run.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(run)],
                                 capture_output=True, text=True, check=False)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        result = subprocess.run(rl_command(run), cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    finally:
        if where == "read-only":
            subprocess.run(["umount", str(run)], check=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith(f"rl: cannot write to the run directory {run}"), result.stderr


def test_an_unknown_model_is_one_line_and_leaves_no_run_dir(tmp_path):
    """The docs' first example once failed on a model that was not there and left an empty run directory behind, so
    the next fresh run with that output_dir was refused as "already holds a run"."""
    run = tmp_path / "runs" / "rl"
    result = run_rl(run, "--model.name=no-such-model", timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "unknown model 'no-such-model'" in result.stderr, result.stderr
    assert not run.exists()


def test_a_run_dir_that_was_there_stays_after_a_setup_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    result = run_rl(run, "--model.name=no-such-model", timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert run.is_dir()


@pytest.mark.integration
def test_resuming_a_finished_run_has_nothing_to_do_and_starts_nothing(tmp_path):
    run = tmp_path / "run"
    first = run_rl(run, "--max_steps=1", timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    metrics = (run / "metrics.jsonl").read_bytes()
    logs = sorted(p.name for p in (run / "logs").iterdir())
    again = run_rl(run, "--max_steps=1", "--resume", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to do" in again.stderr and "1/1 step" in again.stderr, again.stderr
    assert "rl: run " not in again.stdout  # no process was started
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in (run / "logs").iterdir()) == logs


def _snapshot(run: Path, step: int) -> None:
    staged = snapshots.staging_dir(run, step)
    (staged / "model.safetensors").write_bytes(b"weights")
    snapshots.publish(staged, run, step)


def test_a_resume_forgets_what_is_trained_again(tmp_path, capsys):
    run = tmp_path / "run"
    for step in range(1, 6):
        _snapshot(run, step)
    progress = run / "checkpoints" / "step_3" / "trainer" / "progress.json"
    progress.parent.mkdir(parents=True)
    progress.write_text(json.dumps({"step": 3}))
    (run / "checkpoints" / "step_5" / "trainer.tmp").mkdir(parents=True)  # a checkpoint killed while written
    leftover = run / "weights" / ".step_6.tmp-999999"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half a model")
    records = [{"source": "trainer", "step": s} for s in range(1, 6)] + [{"source": "orchestrator", "step": 4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"torn')

    forget_what_is_redone(run, sys.stdout)

    assert snapshots.stable_steps(run) == [1, 2, 3]
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_1", "step_2", "step_3"]
    out = capsys.readouterr().out
    assert f"resuming the trainer from {run / 'checkpoints' / 'step_3'} (step 3)" in out
    assert "removed weight snapshots [4, 5], 1 staging leftover(s), 3 trainer record(s)" in out
    assert [(r["source"], r["step"]) for r in read_metrics(run)] == [
        ("trainer", 1), ("trainer", 2), ("trainer", 3), ("orchestrator", 4)]
