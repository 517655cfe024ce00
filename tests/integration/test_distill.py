"""On-policy distillation end to end on the CPU: `rl` with `orchestrator.advantage.type = "distill"` and a [teacher]
starts a second inference server for the teacher, the orchestrator has it score every sampled sequence, and the
batches carry per-token advantages: the teacher's log-prob minus the sampler's on every sampled token, which this
test recomputes with transformers from the teacher's weights."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import processes_of_run, records, run_rl
from safetensors.torch import load_file, save_file

from primerl.transport.rollouts import read_batch

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


@pytest.fixture
def teacher_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with its weights moved by seeded noise: a teacher that disagrees with the student."""
    out = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir, out)
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    moved = {k: v + 2.0 * v.std() * torch.randn(v.shape, generator=generator) if v.ndim > 1 else v
             for k, v in weights.items()}
    save_file(moved, out / "model.safetensors", metadata={"format": "pt"})
    return out


def samples_of(batch_dir: Path):
    """(token ids, loss mask, inference log-probs, advantages) of every sample of a batch (prompts not shared)."""
    arrays = read_batch(batch_dir).arrays
    out = []
    for index in range(int(arrays["sample_index"].max()) + 1):
        where = arrays["sample_index"] == index
        out.append(tuple(arrays[name][where] for name in ("input_ids", "loss_mask", "inference_logprobs",
                                                          "advantages")))
    return out


def test_distillation_trains_on_the_teachers_per_token_signal(tmp_path, teacher_dir):
    run = tmp_path / "run"
    result = run_rl(run, "--orchestrator.advantage.type=distill", f"--teacher.model.name={teacher_dir}",
                    "--teacher.max_batch_size=4", "--orchestrator.batch.share_prompts=false")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (run / "logs" / "teacher.log").stat().st_size > 0 and (run / "config" / "teacher.toml").is_file()
    batches = records(run, "orchestrator")
    # a k1 estimate (the mean of log p_sampler - log p_teacher over the sampled tokens): noisy, any sign
    assert len(batches) == 3 and all(math.isfinite(b["teacher_kl"]) for b in batches)
    assert all(r["loss"] == r["loss"] for r in records(run, "trainer"))

    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval()
    checked = 0
    for ids, mask, sampler, advantages in samples_of(run / "rollouts" / "step_0"):
        with torch.no_grad():
            logits = teacher(torch.tensor(ids[None].astype(np.int64))).logits[0]
        logprobs = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:].astype(np.int64))]
        expected = np.concatenate([[0.0], logprobs.numpy()]) - sampler
        sampled = mask.astype(bool)
        np.testing.assert_allclose(advantages[sampled], expected[sampled], atol=2e-4)
        assert len(set(np.round(advantages[sampled], 5))) > 1  # per token, not per sample
        checked += 1
    assert checked == 8  # 2 tasks x 4 rollouts
    assert not processes_of_run(run)  # the teacher server was stopped with the rest
