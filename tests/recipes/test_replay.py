"""`primerl.recipes.replay`: the step comparison of `primerl reproduce`, the replay's config, the figures read from a
run directory; `rl --deterministic`'s settings; environment packages pinned by the sha256 of their source tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_helpers import TINY_RECIPE

from primerl.config import load
from primerl.config.rl import DeviceAssignment, RLConfig
from primerl.digests import sha256_tree
from primerl.recipes.pins import verify_pins
from primerl.recipes.replay import (
    ReplayError,
    StepFigures,
    compare_steps,
    read_steps,
    replay_config,
)
from primerl.recipes.stages import load_recipe


def figures(step: int, **changes) -> StepFigures:
    base = {"tokens": "t" * 64, "reward": 0.25, "loss": -0.0123, "grad_norm": 0.5, "weight_checksum": f"w{step}"}
    return StepFigures(step, **{**base, **changes})


def test_identical_steps_of_a_deterministic_run_are_all_equal():
    run = [figures(1), figures(2)]
    comparison = compare_steps(run, list(run), exact=True)
    assert comparison.first_difference is None
    assert all(v == "equal" for s in comparison.steps for v in s.verdicts.values())
    assert comparison.note is None


@pytest.mark.parametrize("name, value", [("tokens", "u" * 64), ("reward", 0.25000001), ("loss", -0.01230000001),
                                         ("grad_norm", 0.5 + 1e-12), ("weight_checksum", "other")])
def test_a_deterministic_run_names_the_first_step_and_field_that_differ_by_any_amount(name, value):
    original = [figures(1), figures(2), figures(3)]
    replay = [figures(1), figures(2, **{name: value}), figures(3, loss=1.0)]
    comparison = compare_steps(original, replay, exact=True)
    assert comparison.first_difference == (2, name)
    assert comparison.as_json()["first_difference"] == {"step": 2, "field": name}
    assert "DIFFERS" in comparison.table() or name in ("tokens", "weight_checksum")


def test_a_step_the_replay_did_not_reach_is_missing():
    comparison = compare_steps([figures(1), figures(2)], [figures(1)], exact=True)
    assert comparison.first_difference == (2, "tokens")
    assert comparison.steps[1].verdicts["loss"] == "missing"


def test_a_run_that_was_not_deterministic_is_compared_within_tolerances_and_says_why():
    original = [figures(1), figures(2)]
    replay = [figures(1, tokens="u" * 64, loss=-0.0124, weight_checksum="x"), figures(2, reward=0.9)]
    comparison = compare_steps(original, replay, exact=False)
    assert comparison.steps[0].verdicts == {"tokens": "unequal", "reward": "equal", "loss": "close",
                                            "grad_norm": "equal", "weight_checksum": "unequal"}
    assert comparison.first_difference == (2, "reward")  # 0.25 vs 0.9: beyond +-0.15
    assert "not deterministic" in comparison.note


def test_checksums_recorded_by_neither_run_are_not_compared():
    run = [figures(1, weight_checksum=None)]
    comparison = compare_steps(run, list(run), exact=False)
    assert comparison.steps[0].verdicts["weight_checksum"] == "n/a" and comparison.first_difference is None


def _manifest(config: dict) -> dict:
    return {"stages": {"rl": {"config": config}}}


def test_the_replay_config_is_the_runs_own_in_a_new_directory_stopped_after_k_steps(tmp_path):
    config = {"output_dir": "${run_dir}", "max_steps": 10, "seed": 7, "deterministic": True, "resume": False,
              "trainer": {"scheduler": {"kind": "cosine", "warmup_steps": 2, "decay_steps": None}}}
    out = tmp_path / "replay"
    replay = replay_config(_manifest(config), out, 3)
    assert (replay["output_dir"], replay["max_steps"], replay["seed"]) == (str(out), 3, 7)
    assert replay["trainer"]["scheduler"]["decay_steps"] == 8  # the run's decay, not one over the 3 replayed steps
    assert config["output_dir"] == "${run_dir}"  # the manifest is left as it was


@pytest.mark.parametrize("steps", [0, 11])
def test_steps_outside_the_run_are_refused(tmp_path, steps):
    with pytest.raises(ReplayError, match="between 1 and the run's max_steps"):
        replay_config(_manifest({"max_steps": 10}), tmp_path, steps)


def test_a_manifest_without_an_rl_stage_is_refused(tmp_path):
    with pytest.raises(ReplayError, match="no RL stage"):
        replay_config({"stages": {"sft": {"config": {}}}}, tmp_path, 1)


def test_figures_are_read_per_step_from_metrics_and_torn_lines_are_skipped(tmp_path):
    records = [{"step": 1, "source": "orchestrator", "reward_mean": 0.5},
               {"step": 1, "source": "trainer", "loss": 0.1, "grad_norm": 2.0, "weight_checksum": "abc"},
               {"step": 2, "source": "trainer", "loss": 0.2, "grad_norm": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + '\n{"step": 3, "sou')
    steps = read_steps(tmp_path, 3)
    assert steps[0] == StepFigures(1, None, 0.5, 0.1, 2.0, "abc")
    assert steps[1] == StepFigures(2, None, None, 0.2, 3.0, None)
    assert steps[2] == StepFigures(3)


def test_deterministic_fixes_the_process_configs():
    cfg, _ = load(RLConfig, ["--deterministic"])
    assert cfg.max_async_steps == 0
    inference, orchestrator, trainer = cfg.process_configs(DeviceAssignment([], []), base_url="http://127.0.0.1:0")
    assert (inference.threads, inference.max_batch_size, inference.compile, inference.model.dtype) == (
        1, 1, False, "float32")
    assert orchestrator.max_async_steps == 0
    assert (trainer.train.threads, trainer.train.backward_dtype, trainer.train.deterministic,
            trainer.train.weight_checksum, trainer.model.dtype) == (1, "float32", True, True, "float32")
    plain, _ = load(RLConfig, [])
    _, _, trainer = plain.process_configs(DeviceAssignment([], []), base_url="http://127.0.0.1:0")
    assert not trainer.train.deterministic and not trainer.train.weight_checksum


def test_deterministic_settings_win_over_the_configs_own():
    cfg, _ = load(RLConfig, ["--deterministic", "--max_async_steps", "2", "--trainer.train.backward_dtype", "bfloat16",
                             "--model.dtype", "bfloat16", "--inference.max_batch_size", "16"])
    assert cfg.max_async_steps == 0
    inference, _, trainer = cfg.process_configs(DeviceAssignment([], []), base_url="http://127.0.0.1:0")
    assert (inference.max_batch_size, inference.model.dtype, trainer.train.backward_dtype, trainer.model.dtype) == (
        1, "float32", "float32", "float32")


def test_deterministic_refuses_vllm():
    with pytest.raises(Exception, match="needs the embedded engine"):
        load(RLConfig, ["--deterministic", "--inference.engine", "vllm"])


def test_deterministic_refuses_a_gpu_in_one_line():
    cfg, _ = load(RLConfig, ["--deterministic"])
    assert cfg.assign_devices(0).inference == []
    with pytest.raises(ValueError, match="CPU only") as e:
        cfg.assign_devices(1)
    assert "\n" not in str(e.value)


def test_the_source_tree_digest_follows_files_not_caches(tmp_path: Path):
    (tmp_path / "pkg" / "data").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "data" / "rows.txt").write_text("a\nb\n")
    before = sha256_tree(tmp_path / "pkg")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"cache")
    (tmp_path / "pkg" / ".swp").write_text("editor")
    assert sha256_tree(tmp_path / "pkg") == before
    (tmp_path / "pkg" / "data" / "rows.txt").write_text("a\nc\n")
    changed = sha256_tree(tmp_path / "pkg")
    (tmp_path / "pkg" / "data" / "rows.txt").rename(tmp_path / "pkg" / "data" / "rows2.txt")
    assert len({before, changed, sha256_tree(tmp_path / "pkg")}) == 3


def test_the_tiny_recipe_pins_its_environment_by_source_tree_and_verifies():
    recipe = load_recipe(TINY_RECIPE)
    assert recipe.pins.environment.sha256 is not None
    checks = {c.name: c for c in verify_pins(recipe).checks}
    tree = checks["environment reverse-text sha256"]
    assert tree.status == "ok", tree
