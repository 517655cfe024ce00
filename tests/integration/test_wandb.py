"""W&B logging, offline. An rl run: the trainer and the orchestrator log to one W&B run whose files hold every
step's metrics (read back from wandb's own transaction log). An eval: its summary as one W&B step."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, records, run_rl

from primerl.wandb_run import RUN_ID_FILE, offline_history


def test_rl_logs_every_step_of_both_processes_to_one_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    result = run_rl(run, "--max_async_steps=0", "--wandb.project=primerl-tests")  # mode online, but WANDB_MODE wins
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = (run / RUN_ID_FILE).read_text().strip()
    history = offline_history(run)
    assert list(history) == [run_id], f"expected one W&B run {run_id}, found {list(history)}"
    rows = history[run_id]
    for source in ("trainer", "orchestrator"):
        expected = records(run, source)
        assert len(expected) == 3
        logged = {row[f"{source}/step"]: row for row in rows if f"{source}/step" in row}
        assert sorted(logged) == [r["step"] for r in expected]
        for record in expected:
            row = logged[record["step"]]
            for key, value in record.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "time":
                    assert row[f"{source}/{key}"] == value, (source, record["step"], key)


def test_eval_logs_its_summary_to_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, "-m", "primerl.cli", "eval", "--model.name=tiny", "--env.id=reverse-text", "--num_examples=2",
         "--rollouts_per_example=2", "--sampling.max_tokens=8", f"--output_dir={out}", "--wandb.project=primerl-tests"],
        check=False, capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((out / "results.json").read_text())
    (rows,) = offline_history(out).values()
    assert [(row["eval/step"], row["eval/avg@2"], row["eval/pass@2"]) for row in rows] == [
        (0, results["avg@2"], results["pass@2"])
    ]
