"""`rl` end to end on the tiny model (CPU): three processes, the async bound, resume after a kill, failures."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from conftest import batch_meta, processes_of_run, records, run_rl, start_rl, wait_for

from primerl.transport import snapshots
from primerl.transport.checkpoints import latest_trainer_step

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def versions(run_dir, step: int) -> list[tuple[int, int]]:
    return [tuple(s["policy_versions"]) for s in batch_meta(run_dir, step)["samples"]]


def test_rl_runs_three_steps_one_step_off_policy(tmp_path):
    run = tmp_path / "run"
    result = run_rl(run, "--max_async_steps=1")
    assert result.returncode == 0, result.stdout + result.stderr
    for step in (1, 2, 3):
        assert f"step {step}/3 |" in result.stdout
    # one numbering: the orchestrator's record of rollouts/step_n is logged under the training step n + 1
    assert [(r["step"], r["rollout_step"]) for r in records(run, "orchestrator")] == [(1, 0), (2, 1), (3, 2)]
    assert [(r["step"], r["rollout_step"]) for r in records(run, "trainer")] == [(1, 0), (2, 1), (3, 2)]
    assert snapshots.stable_steps(run) == [3]  # a finished run keeps its last snapshot only
    assert f"rl: removed the older weight snapshots [1, 2]; the trained model is {run / 'weights' / 'step_3'}" \
        in result.stdout
    for name in ("inference", "orchestrator", "trainer"):
        assert (run / "logs" / f"{name}.log").stat().st_size > 0
    # rollouts for step n come from policy n - 1 or newer, and new weights did reach the server
    seen = [(step, lo, hi) for step in range(3) for lo, hi in versions(run, step)]
    assert all(step - 1 <= lo <= hi <= step for step, lo, hi in seen), seen
    assert max(hi for _, _, hi in seen) >= 1
    reward = records(run, "orchestrator")[0]["reward_mean"]
    assert 0.0 <= reward <= 1.0
    first = records(run, "orchestrator")[0]  # per rollout: single-turn reverse-text, one sample per rollout
    assert first["turns_mean"] == 1 and first["rollouts"] >= first["samples"] and first["step_tokens_per_s"] > 0
    assert 0.0 <= first["truncated_frac"] <= 1.0 and first["completion_len_max"] >= first["completion_len_mean"]
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
    # The first run is long (50 steps) so that it is still running, whatever the machine's speed, when the test sees a
    # complete trainer checkpoint of step 2 or later and kills the launcher. The resumed run goes three steps past
    # every batch the orchestrator had published (it is at most one step ahead of the policy), so it must train on
    # batches it generates itself as well as on those it finds.
    run = tmp_path / "run"
    proc = start_rl(run, "--max_steps=50")
    wait_for(lambda: latest_trainer_step(run) >= 2, timeout=400, what="a trainer checkpoint of step 2 or later",
             proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    wait_for(lambda: not processes_of_run(run), timeout=60, what="the processes to die with their launcher")
    checkpoint = latest_trainer_step(run)
    trained_before = len(records(run, "trainer"))
    batches_before = len(records(run, "orchestrator"))
    assert 2 <= checkpoint <= trained_before < 50
    last = max(trained_before, batches_before) + 3

    result = run_rl(run, f"--max_steps={last}", "--resume")
    assert result.returncode == 0, result.stdout + result.stderr
    resumed_trainer = records(run, "trainer")[trained_before:]
    resumed_orchestrator = records(run, "orchestrator")[batches_before:]
    assert resumed_trainer[0]["step"] == checkpoint + 1, resumed_trainer  # not from scratch: from the checkpoint
    assert resumed_trainer[-1]["step"] == last
    assert resumed_orchestrator and resumed_orchestrator[-1]["step"] == last
    assert f"(resumed at step {checkpoint})" in result.stdout
    assert "resumed from" in (run / "logs" / "trainer.log").read_text()
    assert snapshots.stable_steps(run)[-1] == last


def test_a_dead_trainer_stops_the_run_with_its_log_tail(tmp_path):
    """A trainer killed mid-run stops the run with its log's tail; its shared weight buffer (a file in shared memory,
    which a killed process cannot remove) is removed by rl."""
    run = tmp_path / "run"
    proc = start_rl(run, "--max_steps=50", "--weight_transfer=shared")

    def trainer_pid():
        pids = [pid for pid, cmd in processes_of_run(run).items() if "trainer.toml" in cmd]
        return pids[0] if pids else None

    segment = snapshots.shared_segment_dir(run) / "segment.json"
    wait_for(lambda: trainer_pid() is not None and segment.is_file(), timeout=300, what="the trainer's buffer",
             proc=proc)
    buffer = Path(json.loads(segment.read_text())["path"])
    assert buffer.exists()
    os.kill(trainer_pid(), signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out + err
    assert "trainer was killed by signal 9" in err
    assert "trainer.toml" in err.split("last lines of")[1]  # the tail of the trainer's log: its command line
    assert not processes_of_run(run)
    assert not buffer.exists() and f"rl: removed the trainer's shared weight buffer {buffer}" in err


def test_rl_with_the_weight_broadcast(tmp_path):
    run = tmp_path / "run"
    result = run_rl(run, "--weight_transfer=broadcast", "--max_async_steps=0", "--trainer.ckpt.interval=2",
                    "--keep_weights_after_run=0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert snapshots.stable_steps(run) == [1, 2, 3]
    # step 1: a marker only; step 2: a marker, and full weights as a checkpoint step; step 3, the last: full weights
    step_1, step_2, step_3 = (snapshots.weights_dir(run, step) for step in (1, 2, 3))
    assert snapshots.marker(step_1, snapshots.BROADCAST) and not snapshots.has_files(step_1)
    assert snapshots.marker(step_2, snapshots.BROADCAST) and snapshots.has_files(step_2)
    assert snapshots.marker(step_3, snapshots.BROADCAST) is None and snapshots.has_files(step_3)
    trainer = records(run, "trainer")
    assert [r["weight_transfer"] for r in trainer] == ["broadcast"] * 3
    assert all(r["weights_broadcast_bytes"] > 0 and r["weights_broadcast_buckets"] >= 1 for r in trainer[:2])
    # synchronous: rollouts/step_n are all sampled by policy n, so versions 1 and 2 reached the server (broadcast)
    for step in range(3):
        assert set(versions(run, step)) == {(step, step)}
    inference_log = (run / "logs" / "inference.log").read_text()
    assert "received step 1 by broadcast" in inference_log and "received step 2 by broadcast" in inference_log
    assert "step 2 is live (received by broadcast" in inference_log
    assert not processes_of_run(run)


def test_rl_with_shared_weights(tmp_path):
    """weight_transfer = shared: versions travel through the trainer's shared buffer (shared memory on the CPU); the
    checkpoint step and the last step are written in full as well."""
    run = tmp_path / "run"
    result = run_rl(run, "--weight_transfer=shared", "--max_async_steps=0", "--trainer.ckpt.interval=2",
                    "--keep_weights_after_run=0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert snapshots.stable_steps(run) == [1, 2, 3]
    step_1, step_2, step_3 = (snapshots.weights_dir(run, step) for step in (1, 2, 3))
    assert snapshots.marker(step_1, snapshots.SHARED) and not snapshots.has_files(step_1)
    assert snapshots.marker(step_2, snapshots.SHARED) is None and snapshots.has_files(step_2)
    assert snapshots.marker(step_3, snapshots.SHARED) is None and snapshots.has_files(step_3)
    trainer = records(run, "trainer")
    assert [r["weight_transfer"] for r in trainer] == ["shared"] * 3
    assert trainer[0]["weights_shared_s"] > 0 and "weights_export_s" not in trainer[0]
    for step in range(3):  # synchronous: each batch sampled by exactly the policy before it
        assert set(versions(run, step)) == {(step, step)}
    inference_log = (run / "logs" / "inference.log").read_text()
    assert "copied step 1 from the trainer's shared buffer" in inference_log
    assert not (snapshots.shared_segment_dir(run) / "segment.json").exists()  # the trainer removed its buffer and this
    assert "removed the trainer's shared weight buffer" not in result.stderr
    assert not processes_of_run(run)


def test_broadcast_run_resumes_after_the_launcher_is_killed(tmp_path):
    run = tmp_path / "run"
    overrides = ("--weight_transfer=broadcast", "--trainer.ckpt.interval=3")
    # 50 steps: far more than are trained before the kill on any machine, so the run is always cut short; the test
    # kills it once a step after the first checkpoint is trained, and resumes it to a few steps past what was published
    proc = start_rl(run, "--max_steps=50", *overrides)
    wait_for(lambda: latest_trainer_step(run) >= 3 and len(records(run, "trainer")) > latest_trainer_step(run),
             timeout=400, what="a trained step after a checkpoint", proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    wait_for(lambda: not processes_of_run(run), timeout=60, what="the processes to die with their launcher")
    before = {step: snapshots.marker(snapshots.weights_dir(run, step), snapshots.BROADCAST)
              for step in snapshots.stable_steps(run)}
    steps = max(len(records(run, "trainer")), len(records(run, "orchestrator"))) + 3
    assert steps < 50

    result = run_rl(run, f"--max_steps={steps}", *overrides, "--resume")
    assert result.returncode == 0, result.stdout + result.stderr
    trainer_log = (run / "logs" / "trainer.log").read_text()
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", trainer_log)
    assert resumed, trainer_log[-3000:]
    checkpoint = int(resumed.group(1))
    # The versions trained after that checkpoint were published, some only as markers (they lived in the dead server):
    # the resumed trainer removes them all before it trains those steps again.
    stale = [step for step in before if step > checkpoint]
    assert stale and any(before[step] is not None for step in stale), (checkpoint, before)
    assert f"removed weight snapshots {stale}" in result.stdout  # by the launcher, before any process started
    inference_log = (run / "logs" / "inference.log").read_text()
    # The new server starts at version 0 and catches up either from the checkpoint's full snapshot on disk (when the
    # orchestrator polls after the trainer removed the stale markers) or straight from the next version, trained again
    # and sent through the new group: which comes first depends on who polls first after the restart. Either way that
    # version arrives through the new group, and no batch breaks the async bound (step n sampled by policy >= n - 1).
    restarted = inference_log.split("joined weight group")[-1]
    assert f"received step {checkpoint + 1} by broadcast" in restarted, restarted[-3000:]
    for step in range(steps):
        assert min(first for first, _ in versions(run, step)) >= step - 1, (step, versions(run, step))
    assert snapshots.stable_steps(run)[-1] == steps and snapshots.has_files(snapshots.weights_dir(run, steps))
    assert records(run, "trainer")[-1]["weight_transfer"] == "broadcast"
