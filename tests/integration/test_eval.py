"""`primerl eval` on the tiny model: starts its own server, runs k rollouts per task, writes avg@k and pass@k."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.integration


def test_eval_reports_avg_and_pass_at_k(tmp_path):
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, "-m", "primerl.cli", "eval", "--model.name=tiny", "--env.id=reverse-text",
         "--num_examples=3", "--rollouts_per_example=2", "--sampling.max_tokens=8", "--pass_threshold=0.1",
         f"--output_dir={out}"],
        check=False, capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["num_examples"] == 3 and results["k"] == 2 and results["errors"] == 0
    rewards = [r for example in results["examples"] for r in example["rewards"]]
    assert len(rewards) == 6 and all(0.0 <= r <= 1.0 for r in rewards)
    assert results["avg@2"] == pytest.approx(sum(rewards) / 6)
    passed = [any(r >= 0.1 for r in e["rewards"]) for e in results["examples"]]
    assert results["pass@2"] == pytest.approx(sum(passed) / 3)
    rollouts = [r for example in results["examples"] for r in example["rollouts"]]  # each rollout, as it went
    assert [r["reward"] for r in rollouts] == rewards
    # the chat client has no token ids: the completion length is the server's count of generated tokens
    assert all(r["turns"] == 1 and 0 < r["completion_len"] <= 8 and r["metrics"] == {} for r in rollouts), rollouts
    assert results["turns_mean"] == 1 and results["truncated_frac"] == pytest.approx(
        sum(r["truncated"] for r in rollouts) / 6)
    assert results["completion_len_max"] == max(r["completion_len"] for r in rollouts)
    assert "avg@2" in result.stdout
    assert "engine stopped" in (out / "logs" / "inference.log").read_text()  # the server it started was stopped
