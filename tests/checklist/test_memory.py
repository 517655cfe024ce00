"""`primerl.checklist.memory`: the estimate of each process's peak memory and the checklist step that refuses a run
that will not fit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from primerl.checklist.memory import (
    ModelShape,
    available_bytes,
    embedded_kv_capacity,
    estimate_rl,
    fit_line,
    gpu_fit_line,
    inference_need,
    kv_bytes,
    micro_batch_hint,
)
from primerl.models import resolve_model
from primerl.recipes.stages import load_recipe, validate_stage

ROOT = Path(__file__).resolve().parents[2]
TINY_RECIPE = ROOT / "recipes" / "tiny.toml"
# Qwen3-0.6B's shape (its config.json and safetensors), and a one-GPU run that ran out of memory on an 80 GB H100:
# 256 engine rows, 512 new tokens a call, 2,048-token training rows, the trainer's micro-batch left to auto
QWEN3_06B = ModelShape(params=596_049_920, hidden=1024, layers=28, mlp=3072, vocab=151936, kv_heads=8, head_dim=128,
                       max_positions=40960)
GPU_RUN = {"seq_len": 2048, "weight_transfer": "shared", "model": {"dtype": "bfloat16"},
           "inference": {"max_batch_size": 256, "max_model_len": 40960},
           "orchestrator": {"sampling": {"max_tokens": 512}, "batch": {"tasks_per_step": 64, "group_size": 8}}}
H100 = 80e9


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


def gpu_run(**train) -> dict:
    return {**GPU_RUN, "trainer": {"train": train}} if train else GPU_RUN


def test_colocated_processes_add_up_on_their_gpu():
    """On one GPU `rl` puts the trainer beside the server: the device holds both. The run that ran out of memory on
    an 80 GB H100 (auto micro-batch: 8 rows of 2,048 tokens a pass) is refused; 4 rows a pass fits."""
    recipe = load_recipe(TINY_RECIPE)
    needs = estimate_rl(validate_stage(recipe, "rl", overrides=gpu_run()), QWEN3_06B, on_gpu=True)
    by_role = {n.role: n for n in needs}
    assert by_role["inference"].gpus == by_role["trainer"].gpus == (0,)
    assert max(n.gpu_bytes for n in needs) < H100  # each alone fits: only their sum does not
    fits, line = gpu_fit_line(needs, {0: H100})
    assert not fits and line.startswith("GPU 0 ") and "inference" in line and "trainer" in line and "\n" not in line
    assert "(kv 256 rows x 1025 positions)" in line  # the engine's cache as sized, to read against the prompts
    smaller = estimate_rl(validate_stage(recipe, "rl", overrides=gpu_run(micro_batch_rows=4)), QWEN3_06B, on_gpu=True)
    assert gpu_fit_line(smaller, {0: H100})[0]
    two_gpus = {**gpu_run(), "weight_transfer": "filesystem"}  # shared needs one device
    apart = estimate_rl(validate_stage(recipe, "rl", overrides=two_gpus), QWEN3_06B, on_gpu=True, gpu_count=2)
    assert [n.gpus for n in apart if n.gpus] == [(0,), (1,)]  # two GPUs: the server on one, the trainer on the other
    assert gpu_fit_line(apart, {0: H100, 1: H100})[0]


def test_the_gpu_trainer_estimate_follows_the_auto_micro_batch():
    """Unset, micro_batch_rows is 16,384 tokens a pass on a GPU (8 rows of 2,048): the estimate's activations are
    those of 8 rows, as with micro_batch_rows = 8, where the CPU trainer takes one row a pass."""
    recipe = load_recipe(TINY_RECIPE)

    def trainer(on_gpu: bool, **train) -> float:
        cfg = validate_stage(recipe, "rl", overrides=gpu_run(**train))
        need = estimate_rl(cfg, QWEN3_06B, on_gpu=on_gpu)[-1]
        return need.parts["activations"]

    assert trainer(True) == trainer(True, micro_batch_rows=8) == 8 * trainer(True, micro_batch_rows=1)
    assert trainer(False) == trainer(False, micro_batch_rows=1)


def test_the_embedded_engine_kv_is_what_it_allocates_not_max_model_len():
    """The engine's cache grows to a power of two that covers its longest row, not to max_model_len: 40,960
    positions (the model's own limit, also when max_model_len is unset) would be 1.1 TiB of KV for 256 rows."""
    recipe = load_recipe(TINY_RECIPE)
    need = estimate_rl(validate_stage(recipe, "rl", overrides=gpu_run()), QWEN3_06B, on_gpu=True)[1]
    kv = need.parts["kv cache (256 rows x 1025 positions)"]  # 256-token prompt allowance + 512 new + lookahead
    assert kv == kv_bytes(QWEN3_06B, 2, 256, 1025)
    assert 28 * 2**30 < need.gpu_bytes < 32 * 2**30
    unset = load_recipe(TINY_RECIPE)
    unset.stages["rl"]["inference"].pop("max_model_len")
    overrides = {**GPU_RUN, "inference": {"max_batch_size": 256}}
    assert estimate_rl(validate_stage(unset, "rl", overrides=overrides), QWEN3_06B, on_gpu=True)[1].parts == need.parts


def test_the_kv_capacity_rule_matches_the_engine():
    """`embedded_kv_capacity` against the embedded engine's cache itself (tiny model, on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from primerl.inference.engines.llama import LlamaDecoder

    path = resolve_model("tiny")
    shape = ModelShape.read(path)
    assert shape.max_positions == 2048
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for longest, max_len in ((30, 1000), (300, 1000), (600, 1000), (999, 1000)):
        decoder = LlamaDecoder(model, 3, max_len)
        decoder._reserve(30)  # prefill: the first capacity, then the rows grow
        decoder._reserve(longest)
        allocated = sum(c.numel() * c.element_size() for c in (*decoder.k_cache, *decoder.v_cache))
        assert allocated == kv_bytes(shape, 4, 3, embedded_kv_capacity(longest, max_len)), (longest, max_len)


def test_a_gpu_run_that_does_not_fit_is_told_the_trainer_rows_a_pass_that_would():
    """The refusal names the most rows per pass that fit beside the server (the run that ran out of memory on an 80 GB
    H100 had 8), and says so when not even one row would."""
    recipe = load_recipe(TINY_RECIPE)
    cfg = validate_stage(recipe, "rl", overrides=gpu_run())
    hint = micro_batch_hint(cfg, QWEN3_06B, {0: H100}, estimate_rl(cfg, QWEN3_06B, on_gpu=True))
    match = re.fullmatch(r"; with trainer.train.micro_batch_rows = (\d+) \(now 8\) it would fit", hint)
    assert match, hint
    rows = int(match[1])
    assert 1 <= rows < 8
    fitting = validate_stage(recipe, "rl", overrides=gpu_run(micro_batch_rows=rows))
    assert gpu_fit_line(estimate_rl(fitting, QWEN3_06B, on_gpu=True), {0: H100})[0]
    one_more = validate_stage(recipe, "rl", overrides=gpu_run(micro_batch_rows=rows + 1))
    assert not gpu_fit_line(estimate_rl(one_more, QWEN3_06B, on_gpu=True), {0: H100})[0]
    small = {0: 32 * 2**30}
    needs = estimate_rl(cfg, QWEN3_06B, on_gpu=True, device_bytes=small[0])
    assert "not even with one trainer row" in micro_batch_hint(cfg, QWEN3_06B, small, needs)
