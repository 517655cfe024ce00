"""The restart policy of `rl` (launch/restart.py): when a failed run restarts, when it stops, and what it says."""

from __future__ import annotations

import os
import time

import pytest

from primerl.launch.restart import (
    RESTARTS_LOG,
    STALLED,
    Failure,
    Progress,
    RestartPolicy,
    record_restart,
    restarts_of_run,
)


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
    record_restart(tmp_path, policy, failure, "last lines of trainer.log:\nKilled")
    line = "restart 1/3: trainer was killed by signal 9 at step 3; resuming from step 2"
    assert capsys.readouterr().err == f"rl: {line}\n"
    log = (tmp_path / "logs" / RESTARTS_LOG).read_text()
    assert log.endswith(f" {line}\nlast lines of trainer.log:\nKilled\n\n")
    [record] = restarts_of_run(tmp_path)
    assert (record["process"], record["failed_at_step"], record["resumed_from_step"], record["restart"]) == (
        "trainer", 3, 2, 1)
