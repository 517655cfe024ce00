"""`rl` with the rollouts in worker processes (`orchestrator.workers = 2`) on the tiny model (CPU): the orchestrator
killed mid-run takes its workers with it, and the resumed run trains on the same tasks in the same steps, from the
same first batch, as an uninterrupted run whose rollouts ran in the loop's own process."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest
from conftest import processes_of_run, run_rl, start_rl, wait_for
from drills import tasks_per_step

from primerl.transport.rollouts import read_batch

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]
STEPS = 4


def test_a_run_with_workers_killed_and_resumed_trains_on_the_tasks_of_a_run_without_them(tmp_path):
    reference = tmp_path / "reference"
    done = run_rl(reference, f"--max_steps={STEPS}", "--orchestrator.workers=0")
    assert done.returncode == 0, done.stdout + done.stderr

    run = tmp_path / "run"
    proc = start_rl(run, f"--max_steps={STEPS}", "--orchestrator.workers=2")
    wait_for(lambda: (run / "rollouts" / "step_1").is_dir(), timeout=400, what="the second batch", proc=proc)
    running = processes_of_run(run)
    assert sum("rollout_worker" in cmd for cmd in running.values()) == 2, running
    (orchestrator,) = [pid for pid, cmd in running.items() if "orchestrator.toml" in cmd]
    os.kill(orchestrator, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "orchestrator was killed by signal 9" in err, err[-3000:]
    wait_for(lambda: not processes_of_run(run), timeout=60, what="every process of the run, workers included, to stop")

    resumed = run_rl(run, f"--max_steps={STEPS}", "--orchestrator.workers=2", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "rollouts run in 2 worker processes" in (run / "logs" / "orchestrator.log").read_text()
    assert tasks_per_step(run) == tasks_per_step(reference)
    first, again = (read_batch(r / "rollouts" / "step_0") for r in (reference, run))
    for name in ("input_ids", "loss_mask", "sample_index"):
        np.testing.assert_array_equal(first.arrays[name], again.arrays[name], err_msg=name)
    # The same tokens, sampled from the same seeds; their log-probabilities may differ in the last float32 bit because
    # the engine batched the requests of two worker processes differently from those of one loop.
    np.testing.assert_allclose(
        first.arrays["inference_logprobs"], again.arrays["inference_logprobs"], rtol=0, atol=1e-5, err_msg="logprobs"
    )
    assert not processes_of_run(run)
