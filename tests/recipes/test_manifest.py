"""The manifest: what ran, where, on what. Two runs of one recipe on one machine differ only in the fields the
manifest itself lists as volatile."""

from __future__ import annotations

import hashlib
import json
import runpy

import pytest
from recipe_helpers import RECIPES, ROOT, TINY_RECIPE, primerl

from primerl.config.rl import RECIPE_MAX_RESTARTS, RLConfig
from primerl.recipes import load_recipe
from primerl.recipes.manifest import manifest_differences, read_manifest, without_volatile
from primerl.recipes.plan import plan_run, start_run


def prepared_manifest(run_dir):
    plan = plan_run(load_recipe(TINY_RECIPE), run_dir, progress=None)
    start_run(plan, checklist={"python": "passed"})
    return read_manifest(run_dir)


def test_the_manifest_records_config_pins_versions_code_and_host(tmp_path):
    manifest = prepared_manifest(tmp_path / "run")
    assert manifest["recipe"]["name"] == "tiny"
    rl = manifest["stages"]["rl"]["config"]
    assert rl["output_dir"] == "${run_dir}" and rl["max_steps"] == 3 and rl["model"]["name"] == "tiny"
    assert rl["max_restarts"] == RECIPE_MAX_RESTARTS > 0 == RLConfig().max_restarts  # a recipe restarts by default
    assert {c["name"] for c in manifest["pins"]["checks"]} >= {"python", "lock", "model file model.safetensors"}
    assert manifest["pins"]["drift"] == [] and manifest["pins"]["allow_drift"] is False
    assert manifest["lock"]["sha256"] == load_recipe(TINY_RECIPE).pins.lock_sha256
    assert manifest["packages"]["torch"] and manifest["packages"]["verifiers"] == "0.4.0"
    if (ROOT / ".git").exists():
        assert len(manifest["primerl"]["git_commit"]) == 40
    host = manifest["host"]
    assert host["cpu_cores"] >= 1 and host["memory_gb"] > 0 and host["cpu_model"]
    assert host["gpus"] == [] or all("name" in g for g in host["gpus"])
    assert manifest["checklist"] == {"python": "passed"}
    assert (tmp_path / "run" / "config" / "recipe.rl.toml").is_file()


def test_a_recipes_restarts_can_be_turned_off(tmp_path):
    plan = plan_run(load_recipe(TINY_RECIPE), tmp_path / "run", {"rl": {"max_restarts": 0}}, progress=None)
    assert plan.configs["rl"].max_restarts == 0


def test_two_prepared_runs_differ_only_in_the_listed_volatile_fields(tmp_path):
    first, second = prepared_manifest(tmp_path / "a"), prepared_manifest(tmp_path / "b")
    assert first["volatile_fields"] == second["volatile_fields"]
    assert first["run_id"] != second["run_id"] and first["run_dir"] != second["run_dir"]
    assert manifest_differences(first, second) == []
    assert without_volatile(first) == without_volatile(second)
    changed = json.loads(json.dumps(second))
    changed["stages"]["rl"]["config"]["max_steps"] = 4
    assert manifest_differences(first, changed) == ["stages.rl.config.max_steps: 3 != 4"]


@pytest.mark.integration
def test_two_runs_of_the_tiny_recipe_give_equal_manifests(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    for run_dir in runs:
        proc = primerl("run", str(TINY_RECIPE), "--no-check", "--run-dir", str(run_dir), timeout=1500)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert read_manifest(run_dir)["stages"]["rl"]["status"] == "completed"
    diff = primerl("recipe", "diff", *map(str, runs))
    assert diff.returncode == 0, diff.stdout


@pytest.mark.integration
def test_rl_runs_a_recipe_and_runs_a_plain_config(tmp_path):
    proc = primerl("rl", str(TINY_RECIPE), "--no-check", "--run-dir", str(tmp_path / "recipe"), timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = read_manifest(tmp_path / "recipe")
    assert manifest["recipe"]["name"] == "tiny"
    assert manifest["stages"]["rl"]["restarts"] == 0 and manifest["stages"]["rl"]["restart_causes"] == []
    config = ROOT / "configs" / "debug" / "tiny-rl.toml"
    proc = primerl("rl", "@", str(config), "--output_dir", str(tmp_path / "plain"), "--max_steps", "1", timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "plain" / "manifest.json").exists()


def test_the_pinned_sft_datasets_are_what_the_generator_writes(tmp_path):
    runpy.run_path(str(RECIPES / "data" / "generate_sft_data.py"), run_name="generator")["main"]([str(tmp_path)])
    for recipe_name, key in (("reverse-text-qwen3-0.6b", "./data/reverse-text-sft.jsonl"),
                             ("wordle", "./data/wordle-sft.jsonl")):
        pinned = load_recipe(RECIPES / f"{recipe_name}.toml").pins.data[key]
        assert hashlib.sha256((tmp_path / key.split("/")[-1]).read_bytes()).hexdigest() == pinned
