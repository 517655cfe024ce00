"""`primerl.checklist.memory`: the estimate of each process's peak memory and the checklist step that refuses a run
that will not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from primerl.checklist.memory import ModelShape, available_bytes, estimate_rl, fit_line, inference_need
from primerl.models import resolve_model
from primerl.recipes.stages import load_recipe, validate_stage

ROOT = Path(__file__).resolve().parents[2]
TINY_RECIPE = ROOT / "recipes" / "tiny.toml"


def test_the_model_shape_is_read_from_its_files_and_counts_its_parameters():
    from transformers import AutoModelForCausalLM

    path = resolve_model("tiny")
    shape = ModelShape.read(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.hidden, shape.layers, shape.vocab) == (model.config.hidden_size, model.config.num_hidden_layers,
                                                        model.config.vocab_size)


def test_the_estimate_follows_the_run_sizes():
    shape = ModelShape.read(resolve_model("tiny"))
    recipe = load_recipe(TINY_RECIPE)
    small = estimate_rl(validate_stage(recipe, "rl"), shape)
    large = estimate_rl(validate_stage(recipe, "rl", overrides={"seq_len": 2048, "inference": {
        "max_batch_size": 64, "max_model_len": 2048}}), shape)
    assert [n.role for n in small] == ["launcher", "inference", "orchestrator", "trainer"]
    for before, after in zip(small[1::2], large[1::2], strict=True):  # inference and trainer grow, the others not
        assert after.host_bytes > before.host_bytes
    assert small[2].host_bytes == large[2].host_bytes
    kv = inference_need(shape, 4, 64, 2048, on_gpu=False).parts["kv cache"]
    assert kv == 64 * 2048 * shape.layers * 2 * shape.kv_heads * shape.head_dim * 4


def test_fit_line_names_each_process_and_what_the_machine_has():
    shape = ModelShape.read(resolve_model("tiny"))
    needs = estimate_rl(validate_stage(load_recipe(TINY_RECIPE), "rl"), shape)
    total = sum(n.host_bytes for n in needs)
    fits, line = fit_line(needs, total * 2)
    assert fits and "trainer" in line and "available" in line
    assert not fit_line(needs, total * 0.9)[0]


def check(recipe: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "primerl.cli", "check", str(recipe), "--only", "memory_fit",
                           "--run-dir", str(tmp_path / "run"), "--report", str(report)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    steps = {s["name"]: s for s in json.loads(report.read_text())["steps"]}
    return proc, steps["memory_fit"]


def test_the_tiny_recipe_fits_and_the_step_prints_the_estimate_beside_the_machine(tmp_path):
    proc, step = check(TINY_RECIPE, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert step["status"] == "passed" and "GiB available" in step["detail"] and "trainer" in step["detail"]


def test_a_run_that_will_not_fit_is_refused_in_one_line(tmp_path):
    """An engine batch whose KV cache alone needs more than this machine has available."""
    shape = ModelShape.read(resolve_model("tiny"))
    per_sequence = inference_need(shape, 4, 1, 256, on_gpu=False).parts["kv cache"]
    batch = int(2 * available_bytes() / per_sequence) + 1
    text = TINY_RECIPE.read_text()
    assert text.count("max_batch_size = 8\n") == 1
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(text.replace("max_batch_size = 8\n", f"max_batch_size = {batch}\n"))
    proc, step = check(recipe, tmp_path)
    assert proc.returncode == 1
    assert step["status"] == "failed" and step["detail"].startswith("will not fit: estimated peak")
    assert "\n" not in step["detail"]
