"""`rl` end to end on the tiny model (CPU): three processes, the async bound, resume after a kill, failures."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from conftest import batch_meta, processes_of_run, records, run_rl, start_rl, wait_for

from primerl.transport.weights import stable_steps

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def versions(run_dir, step: int) -> list[tuple[int, int]]:
    return [tuple(s["policy_versions"]) for s in batch_meta(run_dir, step)["samples"]]


def test_rl_runs_three_steps_one_step_off_policy(tmp_path):
    run = tmp_path / "run"
    result = run_rl(run, "--max_async_steps=1")
    assert result.returncode == 0, result.stdout + result.stderr
    for step in (1, 2, 3):
        assert f"step {step}/3 |" in result.stdout
    assert [r["step"] for r in records(run, "orchestrator")] == [0, 1, 2]
    assert [r["step"] for r in records(run, "trainer")] == [1, 2, 3]
    assert stable_steps(run)[-1] == 3
    for name in ("inference", "orchestrator", "trainer"):
        assert (run / "logs" / f"{name}.log").stat().st_size > 0
    # rollouts for step n come from policy n - 1 or newer, and new weights did reach the server
    seen = [(step, lo, hi) for step in range(3) for lo, hi in versions(run, step)]
    assert all(step - 1 <= lo <= hi <= step for step, lo, hi in seen), seen
    assert max(hi for _, _, hi in seen) >= 1
    reward = records(run, "orchestrator")[0]["reward_mean"]
    assert 0.0 <= reward <= 1.0
    assert not processes_of_run(run)


def test_synchronous_rl_samples_every_step_from_the_policy_it_trains(tmp_path):
    run = tmp_path / "run"
    result = run_rl(run, "--max_async_steps=0")
    assert result.returncode == 0, result.stdout + result.stderr
    for step in range(3):
        # rollouts/step_n is what trainer step n + 1 trains on: sampled by policy version n exactly
        assert set(versions(run, step)) == {(step, step)}
    assert [r["policy_lag_max"] for r in records(run, "orchestrator")] == [0, 0, 0]


def test_resume_after_the_launcher_is_killed_continues_from_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = start_rl(run, "--max_steps=4")
    wait_for(lambda: len(records(run, "trainer")) >= 2 and (run / "checkpoints" / "step_2" / "trainer").is_dir(),
             timeout=400, what="two trained steps", proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    wait_for(lambda: not processes_of_run(run), timeout=60, what="the processes to die with their launcher")
    trained_before = len(records(run, "trainer"))
    batches_before = len(records(run, "orchestrator"))

    result = run_rl(run, "--max_steps=4", "--resume")
    assert result.returncode == 0, result.stdout + result.stderr
    resumed_trainer = records(run, "trainer")[trained_before:]
    resumed_orchestrator = records(run, "orchestrator")[batches_before:]
    assert resumed_trainer[0]["step"] >= 3, resumed_trainer  # not from scratch: from checkpoint step >= 2
    assert resumed_trainer[-1]["step"] == 4
    assert resumed_orchestrator and resumed_orchestrator[0]["step"] >= 2
    assert "resumed from" in (run / "logs" / "trainer.log").read_text()
    assert stable_steps(run)[-1] == 4


def test_a_dead_trainer_stops_the_run_with_its_log_tail(tmp_path):
    run = tmp_path / "run"
    proc = start_rl(run, "--max_steps=50")

    def trainer_pid():
        pids = [pid for pid, cmd in processes_of_run(run).items() if "trainer.toml" in cmd]
        return pids[0] if pids else None

    wait_for(lambda: trainer_pid() is not None, timeout=300, what="the trainer to start", proc=proc)
    os.kill(trainer_pid(), signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out + err
    assert "trainer was killed by signal 9" in err
    assert "trainer.toml" in err.split("last lines of")[1]  # the tail of the trainer's log: its command line
    assert not processes_of_run(run)
