"""Pin verification: a tampered weight, data or lock file stops a run before anything is written, printing pinned vs
found; `--allow-drift` proceeds and the manifest records the drift. Tampering happens on copies, never the real files."""

from __future__ import annotations

import hashlib
import os
import re

import pytest
from recipe_helpers import TINY_RECIPE, primerl

from primerl.recipes import load_recipe
from primerl.recipes.manifest import read_manifest
from primerl.recipes.pins import architecture, format_checks, verify_pins, version_matches
from primerl.recipes.plan import DRIFT_EXIT_CODE, plan_run, start_run


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def refused(proc, run_dir, name: str, pinned: str, found: str) -> None:
    assert proc.returncode == DRIFT_EXIT_CODE, proc.stderr
    assert f"{name}: pinned {pinned}, found {found}" in proc.stderr
    assert "nothing was written" in proc.stderr
    assert not run_dir.exists()


def test_the_tiny_recipe_verifies_on_this_machine():
    report = verify_pins(load_recipe(TINY_RECIPE))
    assert report.drifted == []
    names = {c.name for c in report.checks if c.status == "ok"}
    assert {"python", "lock", "package torch", "model file model.safetensors", "environment reverse-text"} <= names
    assert any(name.startswith("data reverse_text/") for name in names)


def test_a_tampered_lock_file_is_refused(tmp_path, tampered_lock):
    pinned = load_recipe(TINY_RECIPE).pins.lock_sha256
    run_dir = tmp_path / "run"
    proc = primerl("run", str(TINY_RECIPE), "--run-dir", str(run_dir), env={"PRIMERL_LOCK_FILE": str(tampered_lock)})
    refused(proc, run_dir, "lock", pinned, sha256(tampered_lock))


def test_a_tampered_weight_file_is_refused(tmp_path, tampered_model_cache, tiny_model_dir):
    pinned = load_recipe(TINY_RECIPE).pins.model.files["model.safetensors"]
    found = sha256(tampered_model_cache / "models" / tiny_model_dir.name / "model.safetensors")
    run_dir = tmp_path / "run"
    proc = primerl("run", str(TINY_RECIPE), "--run-dir", str(run_dir), env={"PRIMERL_CACHE": str(tampered_model_cache)})
    refused(proc, run_dir, "model file model.safetensors", pinned, found)


def test_a_tampered_data_file_is_refused(tmp_path, tampered_data_path):
    key = "reverse_text/data/words.txt"
    pinned = load_recipe(TINY_RECIPE).pins.data[key]
    found = sha256(tampered_data_path / key)
    run_dir = tmp_path / "run"
    pythonpath = os.pathsep.join(filter(None, [str(tampered_data_path), os.environ.get("PYTHONPATH")]))
    proc = primerl("run", str(TINY_RECIPE), "--run-dir", str(run_dir), env={"PYTHONPATH": pythonpath})
    refused(proc, run_dir, f"data {key}", pinned, found)


def test_allow_drift_proceeds_and_the_manifest_records_the_drift(tmp_path, tampered_lock, monkeypatch):
    monkeypatch.setenv("PRIMERL_LOCK_FILE", str(tampered_lock))
    recipe = load_recipe(TINY_RECIPE)
    plan = plan_run(recipe, tmp_path / "run", allow_drift=True, progress=None)
    start_run(plan, checklist=None)
    manifest = read_manifest(tmp_path / "run")
    assert manifest["pins"]["allow_drift"] is True
    assert manifest["pins"]["drift"] == ["lock"]
    lock = next(c for c in manifest["pins"]["checks"] if c["name"] == "lock")
    assert (lock["pinned"], lock["found"], lock["status"]) == (recipe.pins.lock_sha256, sha256(tampered_lock), "drift")
    assert manifest["lock"] == {"path": str(tampered_lock), "sha256": sha256(tampered_lock)}


def test_unpinned_pins_are_reported_as_unpinned_never_as_verified(tmp_path):
    text = TINY_RECIPE.read_text()
    pinned = load_recipe(TINY_RECIPE).pins.model.files["model.safetensors"]
    recipe_path = tmp_path / "tiny.toml"
    recipe_path.write_text(text.replace(pinned, "unpinned"))
    report = verify_pins(load_recipe(recipe_path))
    check = next(c for c in report.checks if c.name == "model file model.safetensors")
    assert (check.status, check.pinned, check.found) == ("unpinned", "unpinned", pinned)
    assert check not in report.drifted and check in report.unpinned


def test_the_pin_report_says_why_an_image_was_not_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("PRIMERL_IMAGE_DIGEST", raising=False)
    other = "arm64" if architecture() == "amd64" else "amd64"
    recipe_path = tmp_path / "tiny.toml"
    recipe_path.write_text(TINY_RECIPE.read_text() + f'\n[pins.images]\n{architecture()} = "unpinned"\n'
                           f'{other} = "unpinned"\n')
    report = format_checks(verify_pins(load_recipe(recipe_path)).checks)
    assert re.search(rf"image {other} +pinned unpinned  found not checked on {architecture()}$", report, re.MULTILINE)
    assert "found not in a container" in report
    assert "None" not in report


@pytest.mark.parametrize(
    ("pinned", "found", "same"),
    [("2.13.0", "2.13.0", True), ("2.13.0", "2.13.0+cpu", True), ("2.13.0+cu130", "2.13.0+cpu", False),
     ("2.13.0", "2.13.1", False), ("2.13", "2.13.0", False)],
)
def test_package_versions_compare_on_the_public_version(pinned, found, same):
    assert version_matches(pinned, found) is same
