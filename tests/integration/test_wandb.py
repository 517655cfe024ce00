"""W&B logging of an rl run, offline: the trainer and the orchestrator log to one W&B run whose files hold every
step's metrics (read back from wandb's own transaction log), with the run's config as the W&B config."""

from __future__ import annotations

from conftest import records, run_rl

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
