"""The restart policy of `rl` (launch/restart.py): when a failed run restarts, when it stops, and what it says."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from primerl.launch.processes import ManagedProcess, stop_all
from primerl.launch.restart import (
    RESTARTS_LOG,
    STALLED,
    Failure,
    Progress,
    RestartPolicy,
    record_restart,
    restart_fields,
    restarts_of_run,
    run_with_restarts,
    watch,
)
from primerl.monitor import MetricsLogger
from primerl.recipes.manifest import MANIFEST_FILE, read_manifest, write_manifest


def test_restarts_until_the_budget_is_spent_then_stops_with_the_cause():
    policy = RestartPolicy(max_restarts=2)
    first = Failure.exited("trainer", -9, step=3)
    assert policy.decide(first).restart
    assert policy.message(first, 2) == "restart 1/2: trainer was killed by signal 9 at step 3; resuming from step 2"
    assert policy.decide(Failure.exited("inference", 1, step=5)).restart
    stop = policy.decide(Failure.exited("orchestrator", 1, step=8))
    assert not stop.restart and policy.restarts == 2
    assert stop.reason == "orchestrator exited with code 1 at step 8; all 2 restart(s) used"


def test_the_same_failure_without_a_new_step_is_a_crash_loop():
    policy = RestartPolicy(max_restarts=10, crash_loop_failures=3)
    same = Failure.exited("trainer", 1, step=4)
    assert policy.decide(same).restart and policy.decide(same).restart
    stop = policy.decide(same)
    assert not stop.restart and policy.restarts == 2
    assert stop.reason.startswith("crash loop: trainer exited with code 1 3 times in a row without a new trained step")


def test_a_new_step_or_another_cause_between_failures_is_no_crash_loop():
    policy = RestartPolicy(max_restarts=10, crash_loop_failures=2)
    assert policy.decide(Failure.exited("trainer", 1, step=4)).restart
    assert policy.decide(Failure.exited("trainer", 1, step=5)).restart  # step 5 was trained in between
    assert policy.decide(Failure.exited("trainer", -9, step=5)).restart  # another cause
    assert not policy.decide(Failure.exited("trainer", -9, step=5)).restart


def test_no_restart_when_off_and_the_line_names_the_cause():
    policy = RestartPolicy(max_restarts=0)
    stop = policy.decide(Failure.stalled(600, step=0))
    assert not stop.restart and policy.restarts == 0
    assert stop.reason == (f"{STALLED} made no progress (no new metrics record) for 600s at step 0; auto-restart is "
                           "off (max_restarts = 0)")
    fresh = RestartPolicy(max_restarts=1)
    failure = Failure.exited("inference", -9, step=0)
    assert fresh.decide(failure).restart
    assert fresh.message(failure, 0).endswith("; starting again from the initial model")


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=1, crash_loop_failures=1)


def test_progress_is_the_metrics_file_growing(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    progress = Progress(metrics)
    time.sleep(0.05)
    assert progress.idle_s() >= 0.05  # no file yet: no progress
    metrics.write_text('{"step": 1}\n')
    assert progress.idle_s() < 0.05
    time.sleep(0.05)
    assert progress.idle_s() >= 0.05
    with open(metrics, "a") as f:
        f.write('{"step": 2}\n')
    os.utime(metrics)
    assert progress.idle_s() < 0.05


def test_a_restart_is_one_line_on_stderr_a_line_in_the_restarts_log_and_a_metrics_record(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    checkpoint = tmp_path / "checkpoints" / "step_2" / "trainer" / "progress.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text("{}")
    policy = RestartPolicy(max_restarts=3)
    failure = Failure.exited("trainer", -9, step=3)
    assert policy.decide(failure).restart
    record_restart(tmp_path, policy, failure, "last lines of trainer.log:\nKilled", "gpu1")
    line = "restart 1/3: trainer was killed by signal 9 at step 3; resuming from step 2"
    assert capsys.readouterr().err == f"rl: {line}\n"
    log = (tmp_path / "logs" / RESTARTS_LOG).read_text()
    assert log.endswith(f" {line}\nlast lines of trainer.log:\nKilled\n\n")
    [record] = restarts_of_run(tmp_path)
    assert (record["process"], record["host"], record["failed_at_step"], record["resumed_from_step"],
            record["restart"]) == ("trainer", "gpu1", 3, 2, 1)
    assert not (tmp_path / MANIFEST_FILE).exists()  # a plain config's run has no manifest: none is made


def test_each_restart_is_counted_in_the_runs_manifest_as_it_happens(tmp_path, capsys):
    """A recipe's run (rl, launch ssh) has a manifest: every restart updates its rl stage at once (the number, one
    line and one entry each), so a launcher that dies later still leaves them counted there."""
    (tmp_path / "logs").mkdir()
    write_manifest(tmp_path, {"updated_at": "then", "stages": {"rl": {"status": "running", "config": {}}}})
    (tmp_path / "checkpoints" / "step_1" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_1" / "trainer" / "progress.json").write_text("{}")
    policy = RestartPolicy(max_restarts=3)
    for failure, host in ((Failure.exited("trainer.0 on host b", -9, step=2), "b"), (Failure.stalled(60, 3), None)):
        assert policy.decide(failure).restart
        record_restart(tmp_path, policy, failure, None, host, prefix="launch")
    manifest = read_manifest(tmp_path)
    rl = manifest["stages"]["rl"]
    assert rl["status"] == "running" and rl["config"] == {} and manifest["updated_at"] != "then"
    assert rl["restarts"] == 2
    assert rl["restart_causes"] == ["trainer.0 on host b was killed by signal 9 at step 2",
                                    f"{STALLED} made no progress (no new metrics record) for 60s at step 3"]
    assert rl["restart_entries"] == [
        {"restart": 1, "process": "trainer.0 on host b", "host": "b", "cause": "was killed by signal 9",
         "failed_at_step": 2, "resumed_from_step": 1},
        {"restart": 2, "process": STALLED, "host": None, "cause": "made no progress (no new metrics record) for 60s",
         "failed_at_step": 3, "resumed_from_step": 1},
    ]
    assert rl == {**rl, **restart_fields(tmp_path)}
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    assert policy.decide(Failure.exited("orchestrator", 1, step=4)).restart
    record_restart(tmp_path, policy, Failure.exited("orchestrator", 1, step=4), None, "gpu1")  # goes on regardless
    assert len(restarts_of_run(tmp_path)) == 3
    assert "rl: the restart is not counted in" in capsys.readouterr().err


def _process(tmp_path, name: str, code: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def _watch(processes, tmp_path, stall_timeout_s: float = 0.0, steps: int = 0):
    for p in processes:
        p.start()
    try:
        return watch(processes, name=lambda p: p.name, finishes=lambda p: p.name != "server",
                     stop=lambda ps: stop_all(ps, 5.0), steps_done=lambda: steps,
                     progress=Progress(tmp_path / "metrics.jsonl"), stall_timeout_s=stall_timeout_s, poll_s=0.05)
    finally:
        stop_all(processes, 5.0)


def test_watch_ends_when_the_finishers_exit_0_and_stops_the_server(tmp_path):
    server = _process(tmp_path, "server", "import time; time.sleep(60)")
    trainer = _process(tmp_path, "trainer", "pass")
    assert _watch([server, trainer], tmp_path) is None
    assert trainer.poll() == 0 and server.poll() is not None and server.poll() != 0  # stopped, not finished


def test_watch_names_the_process_that_died_and_stops_the_others(tmp_path):
    server = _process(tmp_path, "server", "import time; time.sleep(60)")
    trainer = _process(tmp_path, "trainer", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert _watch([server, trainer], tmp_path, steps=4) == Failure("trainer", "was killed by signal 9", 4)
    assert server.poll() is not None


def test_watch_sees_a_run_without_new_metrics_records_as_stalled(tmp_path):
    server = _process(tmp_path, "server", "import time; time.sleep(60)")
    trainer = _process(tmp_path, "trainer", "import time; time.sleep(60)")
    failure = _watch([server, trainer], tmp_path, stall_timeout_s=0.5, steps=2)
    assert failure is not None and (failure.process, failure.step) == (STALLED, 2)
    assert failure.cause.startswith("made no progress")
    assert server.poll() is not None and trainer.poll() is not None


def test_run_with_restarts_restarts_while_the_policy_allows_then_gives_up_with_the_reason():
    outcomes = iter([Failure.exited("trainer", 1, 0), Failure.exited("trainer", 1, 1), 0])
    restarted, given_up = [], []
    code = run_with_restarts(RestartPolicy(2), lambda: next(outcomes), lambda f, why: given_up.append(why) or 1,
                             restarted.append)
    assert code == 0 and [f.step for f in restarted] == [0, 1] and given_up == []
    policy = RestartPolicy(1)
    code = run_with_restarts(policy, lambda: Failure.exited("trainer", 1, 0), lambda f, why: given_up.append(why) or 7,
                             restarted.append)
    assert code == 7 and given_up == ["trainer exited with code 1 at step 0; all 1 restart(s) used"]


def test_the_host_side_records_a_restart_and_forgets_what_is_redone(tmp_path):
    """`python -m primerl.launch.restart` (what `launch ssh` runs on a host): the trained steps, then a restart's
    record, its line, and the trainer's records after the checkpoint dropped."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "checkpoints" / "step_1" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_1" / "trainer" / "progress.json").write_text("{}")
    trainer = MetricsLogger(tmp_path, "trainer")
    trainer.log(1, {"loss": 1.0})
    trainer.log(2, {"loss": 0.5})
    host_side = [sys.executable, "-m", "primerl.launch.restart"]
    steps = subprocess.run([*host_side, "steps", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                           check=True)
    assert steps.stdout.strip() == "2"
    done = subprocess.run([*host_side, "record", "--run-dir", str(tmp_path), "--restart", "1", "--max-restarts", "3",
                           "--process", "trainer.0 on host b", "--cause", "was killed by signal 9", "--step", "2",
                           "--host", "b"],
                          input="last lines of trainer.0@b.log:\nKilled\n", capture_output=True, text=True, check=True)
    assert done.stderr.splitlines()[0] == ("launch: restart 1/3: trainer.0 on host b was killed by signal 9 at step "
                                           "2; resuming from step 1")
    [record] = restarts_of_run(tmp_path)
    assert (record["process"], record["host"], record["failed_at_step"], record["resumed_from_step"]) == (
        "trainer.0 on host b", "b", 2, 1)
    assert "Killed" in (tmp_path / "logs" / RESTARTS_LOG).read_text()
    again = subprocess.run([*host_side, "steps", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                           check=True)
    assert again.stdout.strip() == "1"  # step 2 is trained again: its record went
    bad = subprocess.run([*host_side, "record", "--run-dir", str(tmp_path), "--restart", "4", "--max-restarts", "3"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--restart 4" in bad.stderr and len(restarts_of_run(tmp_path)) == 1


def test_a_requeued_slurm_job_records_its_restart_like_the_others(tmp_path):
    """What a one-node Slurm job that Slurm requeued runs before it resumes the run (job.sbatch.j2): the restart's
    line, its record in metrics.jsonl and its entry in the manifest, with the job, the node and the steps."""
    write_manifest(tmp_path, {"updated_at": "then", "stages": {"rl": {"status": "completed"}}})
    (tmp_path / "checkpoints" / "step_2" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_2" / "trainer" / "progress.json").write_text("{}")
    trainer = MetricsLogger(tmp_path, "trainer")
    for step in (1, 2, 3):
        trainer.log(step, {"loss": 1.0})
    done = subprocess.run([sys.executable, "-m", "primerl.launch.restart", "requeued", "--run-dir", str(tmp_path),
                           "--prefix", "primerl", "--host", "n1", "--job", "7", "--count", "1"],
                          capture_output=True, text=True, check=True)
    line = ("primerl: restart (requeue 1): slurm job 7 was requeued by Slurm (SLURM_RESTART_COUNT 1) at step 3; "
            "resuming from step 2")
    assert done.stderr.splitlines() == [line]
    [record] = restarts_of_run(tmp_path)
    assert (record["process"], record["host"], record["failed_at_step"], record["resumed_from_step"]) == (
        "slurm job 7", "n1", 3, 2)
    assert line.removeprefix("primerl: ") in (tmp_path / "logs" / RESTARTS_LOG).read_text()
    assert read_manifest(tmp_path)["stages"]["rl"]["restart_entries"] == [{
        "restart": 1, "process": "slurm job 7", "host": "n1",
        "cause": "was requeued by Slurm (SLURM_RESTART_COUNT 1)", "failed_at_step": 3, "resumed_from_step": 2}]
