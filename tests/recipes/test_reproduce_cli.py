"""`primerl reproduce`'s refusals: each is one line on stderr, a non-zero exit, and nothing replayed or written. The run
directories here are made from the tiny recipe's manifest fields without training (the replay itself:
tests/integration/test_reproduce.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_helpers import TINY_RECIPE, primerl

from primerl.recipes.stages import load_recipe, validate_stage


def fake_run(run_dir: Path, **pin_changes: dict) -> Path:
    """A run directory with the tiny recipe's manifest (pins as declared, with `pin_changes` merged into the
    declared tables) and two trainer steps in metrics.jsonl."""
    recipe = load_recipe(TINY_RECIPE)
    declared = recipe.pins.model_dump(mode="json", exclude_none=True)
    for table, values in pin_changes.items():
        declared[table] = {**declared[table], **values}
    config = validate_stage(recipe, "rl", run_dir=run_dir).model_dump(mode="json")
    manifest = {
        "recipe": {"name": recipe.name, "path": str(recipe.path), "description": recipe.info.description,
                   "stages": recipe.info.stages, "requires": [], "hardware": recipe.info.hardware.model_dump()},
        "pins": {"declared": declared},
        "stages": {"rl": {"config": json.loads(json.dumps(config).replace(str(run_dir), "${run_dir}"))}},
    }
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    lines = [{"step": s, "source": "trainer", "loss": 0.1, "grad_norm": 1.0} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def refused(result, code: int, words: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("primerl reproduce: error:") and words in lines[-1], result.stderr
    assert not any("Traceback" in line for line in lines), result.stderr


def test_a_directory_without_a_manifest_is_refused(tmp_path):
    refused(primerl("reproduce", str(tmp_path), "--out", str(tmp_path / "out")), 2, "has no manifest.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("steps", ["0", "4"])
def test_steps_beyond_the_run_are_refused(tmp_path, steps):
    run = fake_run(tmp_path / "run")
    refused(primerl("reproduce", str(run), "--steps", steps, "--out", str(tmp_path / "out")), 2,
            "between 1 and the run's max_steps (3)")
    assert not (tmp_path / "out").exists()


def test_an_output_directory_in_use_is_refused(tmp_path):
    run = fake_run(tmp_path / "run")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    refused(primerl("reproduce", str(run), "--out", str(tmp_path / "out")), 2, "already exists and is not empty")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_a_run_that_never_trained_is_refused(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    refused(primerl("reproduce", str(run), "--out", str(tmp_path / "out")), 2, "no trainer metrics")


@pytest.mark.parametrize("table, pin, name", [
    ("data", {"reverse_text/data/words.txt": "0" * 64}, "data reverse_text/data/words.txt"),
    ("environment", {"sha256": "1" * 64}, "environment reverse-text sha256"),
])
def test_drift_of_a_pin_is_refused_in_one_line_with_exit_3(tmp_path, table, pin, name):
    run = fake_run(tmp_path / "run", **{table: pin})
    result = primerl("reproduce", str(run), "--out", str(tmp_path / "out"))
    refused(result, 3, "1 pin(s) of run differ from this machine")
    assert name in result.stderr and "--allow-drift replays anyway" in result.stderr
    assert not (tmp_path / "out").exists()
