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
