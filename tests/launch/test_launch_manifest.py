"""The manifest of a run a remote launcher starts (launch/manifest.py, run on the first host by `launch ssh`): the
manifest `primerl run` writes, from the recipe and `<run>/launch/plan.json`, with the rl stage's outcome and
restarts."""

from __future__ import annotations

import json
from pathlib import Path

from primerl.launch.manifest import PLAN_FILE, main
from primerl.launch.restart import Failure, RestartPolicy, record_restart
from primerl.recipes.manifest import MANIFEST_FILE, read_manifest

TINY_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"


def _launch_record(run_dir: Path) -> dict:
    record = {
        "recipe": {"name": "tiny", "path": str(TINY_RECIPE)},
        "overrides": {"rl": {"max_steps": "2"}},
        "hosts": {"a": "10.0.0.2", "b": "10.0.0.3"},
        "processes": [{"label": "trainer.0@b", "role": "trainer", "host": "b", "args": []}],
        "checklist": {"a": {"connect": "passed", "python": "passed"}, "b": {"connect": "passed"}},
    }
    (run_dir / PLAN_FILE).parent.mkdir(parents=True)
    (run_dir / PLAN_FILE).write_text(json.dumps(record))
    return record


def test_start_writes_the_recipes_manifest_with_the_launch_and_end_records_the_outcome_and_restarts(tmp_path):
    run_dir = tmp_path / "run"
    record = _launch_record(run_dir)
    assert main(["start", "--run-dir", str(run_dir), "--recipe", str(TINY_RECIPE), "--host", "a"]) == 0
    manifest = read_manifest(run_dir)
    assert manifest["recipe"]["name"] == "tiny" and manifest["pins"]["drift"] == []
    assert manifest["packages"]["torch"] and manifest["host"]["cpu_cores"] >= 1
    assert manifest["launch"] == record and manifest["checklist"] == record["checklist"]["a"]
    assert manifest["overrides"] == {"rl": {"max_steps": "2"}}
    rl = manifest["stages"]["rl"]
    assert rl["status"] == "running" and rl["config"]["max_steps"] == 2 and rl["config"]["output_dir"] == "${run_dir}"
    assert (run_dir / "config" / "recipe.rl.toml").is_file()

    (run_dir / "logs").mkdir()
    policy = RestartPolicy(2)
    failure = Failure.exited("trainer.0 on host b", -9, step=1)
    assert policy.decide(failure).restart
    record_restart(run_dir, policy, failure, None, "b", prefix="launch")
    assert read_manifest(run_dir)["stages"]["rl"]["restarts"] == 1  # counted at once, before the run ends
    assert main(["end", "--run-dir", str(run_dir), "--exit-code", "0"]) == 0
    rl = read_manifest(run_dir)["stages"]["rl"]
    assert (rl["status"], rl["exit_code"], rl["restarts"]) == ("completed", 0, 1)
    assert rl["restart_entries"] == [
        {
            "restart": 1,
            "process": "trainer.0 on host b",
            "host": "b",
            "cause": "was killed by signal 9",
            "failed_at_step": 1,
            "resumed_from_step": 0,
        }
    ]
    assert main(["end", "--run-dir", str(run_dir), "--exit-code", "130"]) == 0
    assert read_manifest(run_dir)["stages"]["rl"]["status"] == "interrupted"


def test_a_drifted_pin_stops_start_with_the_pin_named_and_writes_no_manifest(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _launch_record(run_dir)
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(TINY_RECIPE.read_text().replace('python = "3.11"', 'python = "2.7"'))
    assert main(["start", "--run-dir", str(run_dir), "--recipe", str(recipe), "--host", "a"]) == 3
    [line] = capsys.readouterr().err.splitlines()  # one line, as the launcher shows it, the drifted pin in it
    assert line.startswith("error: ") and "pin(s) differ from this machine" in line and "python" in line, line
    assert not (run_dir / MANIFEST_FILE).exists()


def test_the_checklist_comes_from_the_hosts_report_when_the_launch_record_has_none(tmp_path):
    run_dir = tmp_path / "run"
    _launch_record(run_dir)
    (run_dir / PLAN_FILE).write_text(json.dumps({"overrides": {}}))  # a Slurm job's plan: no checklist yet
    (run_dir / "checklist").mkdir()
    (run_dir / "checklist" / "node7.json").write_text(json.dumps({"steps": [{"name": "python", "status": "passed"}]}))
    assert main(["start", "--run-dir", str(run_dir), "--recipe", str(TINY_RECIPE), "--host", "node7"]) == 0
    assert read_manifest(run_dir)["checklist"] == {"python": "passed"}
