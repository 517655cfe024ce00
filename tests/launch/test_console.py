"""`rl`'s console: one line per trained step, the batch's orchestrator record next to the trainer's."""

import io

from primerl.launch.console import Console
from primerl.monitor import MetricsLogger


def test_one_line_per_trained_step_with_both_sides(tmp_path):
    out = io.StringIO()
    console = Console(tmp_path, max_steps=5, first_step=0, stream=out)
    MetricsLogger(tmp_path, "orchestrator").log(1, {"reward_mean": 0.25, "policy_lag_max": 0, "rollout_step": 0})
    MetricsLogger(tmp_path, "orchestrator").log(2, {"reward_mean": 0.5, "rollout_step": 1})
    console.poll()
    assert out.getvalue() == ""  # nothing trained yet
    MetricsLogger(tmp_path, "trainer").log(1, {"loss": 0.125, "rollout_step": 0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "source": "trai')  # a record still being written
    console.poll()
    assert out.getvalue().splitlines() == ["step 1/5 | reward_mean 0.25 | policy_lag_max 0 | loss 0.125"]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('ner", "loss": 0.5, "rollout_step": 1}\n')
    console.poll()
    assert out.getvalue().splitlines()[1] == "step 2/5 | reward_mean 0.5 | loss 0.5"
    assert console.steps_done == 2


def test_a_resumed_run_only_shows_new_records(tmp_path):
    MetricsLogger(tmp_path, "trainer").log(1, {"loss": 1.0, "rollout_step": 0})
    out = io.StringIO()
    console = Console(tmp_path, max_steps=3, first_step=1, stream=out)
    MetricsLogger(tmp_path, "trainer").log(2, {"loss": 0.5, "rollout_step": 1})
    console.poll()
    assert out.getvalue().splitlines() == ["step 2/3 | loss 0.5"]


def test_a_long_wait_for_the_first_step_says_what_it_waits_for(tmp_path):
    import time

    out = io.StringIO()
    console = Console(tmp_path, max_steps=5, first_step=0, stream=out)
    console.WAIT_LINE_EVERY_S = 0.05
    time.sleep(0.1)
    console.poll()
    assert out.getvalue().startswith("rl: waiting for step 1: the server loads the model")
    MetricsLogger(tmp_path, "orchestrator").log(1, {"reward_mean": 0.25, "rollout_step": 0})
    console.poll()
    time.sleep(0.1)
    console.poll()
    assert "waiting for step 1: the trainer trains on the first batch" in out.getvalue().splitlines()[-1]
    MetricsLogger(tmp_path, "trainer").log(1, {"loss": 0.125, "rollout_step": 0})
    console.poll()
    time.sleep(0.1)
    console.poll()
    assert out.getvalue().splitlines()[-1].startswith("step 1/5")  # trained: no more waiting lines


def test_waiting_prints_a_line_every_few_seconds_until_the_block_ends():
    import time

    from primerl.waiting import Waiting

    out = io.StringIO()
    with Waiting("dequantizing the weights", prog="primerl", every_s=0.05, stream=out):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and all(line.startswith("primerl: still dequantizing the weights (") for line in lines)
    time.sleep(0.15)
    assert out.getvalue().splitlines() == lines  # nothing after the block


def test_counts_are_singular_for_one():
    from primerl.launch.console import count

    assert count(1, "step") == "1 step" and count(40, "step") == "40 steps" and count(0, "step") == "0 steps"


def test_a_signal_while_stopping_is_one_line_not_a_traceback():
    import subprocess
    import sys

    code = ("import os, signal, time\nfrom primerl.launch.console import stop_quietly\n"
            "stop_quietly('rl')\nos.kill(os.getpid(), signal.SIGTERM)\nos.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(0.2)\nprint('stopped in order')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout == "stopped in order\n"
    assert proc.stderr.splitlines() == ["rl: stopping already; SIGKILL ends it at once"] * 2
