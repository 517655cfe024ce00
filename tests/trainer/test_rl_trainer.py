"""The RL trainer end to end on the tiny model: batches from the run directory, weights out, resume after a kill,
loss normalisation independent of how a step is split into micro-batches."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import read_metrics, write_fixed_batches

from primerl.config import load
from primerl.config.trainer import TrainerConfig
from primerl.trainer.rl import train
from primerl.transport import snapshots

pytestmark = pytest.mark.integration

BASE_ARGS = [
    "--model.name",
    "tiny",
    "--optim.lr",
    "1e-3",
    "--train.micro_batch_rows",
    "1",
    "--data.poll_interval_s",
    "0.05",
    "--loss.kwargs",
    '{"kl_coef": 0.05}',
]


def config(run_dir, *extra) -> TrainerConfig:
    cfg, _ = load(TrainerConfig, [*BASE_ARGS, "--run_dir", str(run_dir), *extra])
    return cfg


def trainer_process(run_dir, *extra) -> subprocess.Popen:
    # the same thread count as this process: CPU reductions then add up in the same order in both runs
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, "-m", "primerl.trainer.rl", *BASE_ARGS, "--run_dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_trains_on_rollouts_and_publishes_weights(tmp_path):
    write_fixed_batches(tmp_path, range(3))
    train(config(tmp_path, "--train.max_steps", "3", "--weights.keep_last", "2"))
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == [1, 2, 3]
    assert [metrics[k]["rollout_step"] for k in (1, 2, 3)] == [0, 1, 2]
    for m in metrics.values():
        assert m["num_loss_tokens"] > 0 and m["loss"] == m["loss"]
        assert 0 <= m["masked_fraction"] <= 1 and m["mismatch_kl"] >= 0 and m["entropy"] > 0
        assert m["wait_s"] >= 0 and m["tokens_per_s"] > 0
    assert snapshots.stable_steps(tmp_path) == [2, 3]  # keep_last = 2
    snapshot = snapshots.weights_dir(tmp_path, 3)
    from transformers import AutoModelForCausalLM

    from primerl.models import resolve_model

    reloaded = AutoModelForCausalLM.from_pretrained(snapshot)
    initial = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"))
    state = load_file(snapshot / "model.safetensors")
    assert "lm_head.weight" not in state  # tied: stored once
    moved = [n for n, p in initial.named_parameters() if not torch.equal(p, reloaded.get_parameter(n))]
    assert moved, "exported weights equal the initial ones"
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.isfinite(reloaded(ids).logits).all()


def test_the_trainer_prunes_batches_no_resume_can_read_and_a_resume_still_finds_its_own(tmp_path):
    from primerl.transport.checkpoints import published_batches

    write_fixed_batches(tmp_path, range(8))
    train(config(tmp_path, "--train.max_steps", "6", "--ckpt.interval", "2", "--ckpt.keep_last", "2",
                 "--ckpt.keep_rollouts", "1", "--ckpt.save_at_end=false"))
    # checkpoints 4 and 6 kept: a resume reads rollouts/step_4 onwards; of 0..3, the newest (3) stays
    assert published_batches(tmp_path) == [3, 4, 5, 6, 7]
    train(config(tmp_path, "--train.max_steps", "8", "--ckpt.resume", "4", "--ckpt.interval", "2",
                 "--ckpt.keep_rollouts", "1"))
    assert sorted(read_metrics(tmp_path))[-4:] == [5, 6, 7, 8]


def test_warm_up_before_the_first_batch_changes_no_step(tmp_path, caplog):
    plain, warmed = tmp_path / "plain", tmp_path / "warmed"
    for run_dir in (plain, warmed):
        write_fixed_batches(run_dir, range(2))
    train(config(plain, "--train.max_steps", "2", "--train.micro_batch_rows", "2"))
    with caplog.at_level("INFO", logger="primerl.trainer.rl"):
        train(config(warmed, "--train.max_steps", "2", "--train.micro_batch_rows", "2", "--train.warm_up_tokens", "48"))
    assert "warmed up on 2 dummy row(s) of 48 tokens" in caplog.text  # a step's micro-batch: its kernels' shapes
    expected, got = read_metrics(plain), read_metrics(warmed)
    for step in (1, 2):
        assert [got[step][k] for k in ("loss", "grad_norm", "entropy")] == [
            expected[step][k] for k in ("loss", "grad_norm", "entropy")], step
    a, b = (load_file(snapshots.weights_dir(d, 2) / "model.safetensors") for d in (plain, warmed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_warm_up_drops_its_gradients_and_leaves_weights_and_optimizer_alone(tmp_path):
    from primerl.trainer.core import Trainer, TrainerParts, micro_batches
    from primerl.trainer.loss import LossOutput
    from primerl.transport.rollouts import Sample, pack_samples

    trainer = Trainer(TrainerParts.of(config(tmp_path)), source="trainer")
    try:
        before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
        seen = []

        def loss(out, mb):  # a loss whose gradient is not zero anywhere
            seen.append(1)
            return LossOutput(loss_sum=(out.logprobs * mb["loss_mask"]).sum())

        packed = pack_samples([Sample(list(range(1, 33)), [0] * 16 + [1] * 16, [0.0] * 32, 0.0)], 32)
        trainer.warm_up(micro_batches(packed.arrays, 1, trainer.device), loss)
        assert seen == [1]
        assert all(p.grad is None for p in trainer.policy.parameters())
        assert not trainer.optimizer.state  # no step taken, no state made
        assert all(torch.equal(p, before[n]) for n, p in trainer.policy.named_parameters())
    finally:
        trainer.close()


def test_resume_after_kill_repeats_the_same_steps(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    write_fixed_batches(straight, range(4))
    train(config(straight, "--train.max_steps", "4"))
    expected = read_metrics(straight)

    # interrupted run: batches 0..2 only; checkpoint at step 2; it trains step 3 then waits for rollouts/step_3
    write_fixed_batches(killed, range(3))
    proc = trainer_process(killed, "--train.max_steps", "4", "--ckpt.interval", "2", "--ckpt.keep_last", "1")
    deadline = time.monotonic() + 300
    while 3 not in (read_metrics(killed) if (killed / "metrics.jsonl").exists() else {}):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "trainer made no progress"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "step_2" / "trainer" / "progress.json").is_file()
    assert not (killed / "checkpoints" / "step_4").exists()

    write_fixed_batches(killed, [3])
    (killed / "metrics.jsonl").rename(killed / "metrics.before-kill.jsonl")
    train(config(killed, "--train.max_steps", "4", "--ckpt.resume", "latest"))
    resumed = read_metrics(killed)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl", "lr"):
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_loss_is_normalised_over_the_whole_step(tmp_path):
    """Two rows in one micro-batch or in two: the same loss and the same update."""
    write_fixed_batches(tmp_path / "a", [0], seq_len=32)
    write_fixed_batches(tmp_path / "b", [0], seq_len=32)
    # float32 gradients: bfloat16 ones round differently per layout, and Adam magnifies that on near-zero gradients
    exact = ("--train.max_steps", "1", "--train.backward_dtype", "float32")
    train(config(tmp_path / "a", *exact, "--train.micro_batch_rows", "8"))
    train(config(tmp_path / "b", *exact, "--train.micro_batch_rows", "1"))
    a, b = read_metrics(tmp_path / "a")[1], read_metrics(tmp_path / "b")[1]
    assert a["num_loss_tokens"] == b["num_loss_tokens"]
    for key in ("loss", "grad_norm", "entropy", "mismatch_kl", "masked_fraction"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    wa = load_file(snapshots.weights_dir(tmp_path / "a", 1) / "model.safetensors")
    wb = load_file(snapshots.weights_dir(tmp_path / "b", 1) / "model.safetensors")
    for name in wa:  # Adam divides by sqrt(v): summation-order noise on near-zero grads shows at ~1e-6 (lr 1e-3)
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-5)


def test_lora_trains_adapters_and_exports_merged_weights(tmp_path):
    write_fixed_batches(tmp_path, range(2))
    train(config(tmp_path, "--train.max_steps", "2", "--lora.enabled", "--lora.rank", "4"))
    from transformers import AutoModelForCausalLM

    state = load_file(snapshots.weights_dir(tmp_path, 2) / "model.safetensors")
    assert not [k for k in state if "lora" in k or "base_layer" in k]
    reloaded = AutoModelForCausalLM.from_pretrained(snapshots.weights_dir(tmp_path, 2))
    from primerl.models import resolve_model

    initial = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(initial.get_parameter(q), reloaded.get_parameter(q))  # adapters merged in
    emb = "model.embed_tokens.weight"
    assert torch.equal(initial.get_parameter(emb), reloaded.get_parameter(emb))  # frozen base


def test_auto_micro_batches_hold_a_fixed_token_budget_on_a_gpu_and_one_row_on_the_cpu():
    from primerl.trainer.core import AUTO_MICRO_BATCH_TOKENS, auto_micro_batch_rows

    assert auto_micro_batch_rows(512, torch.device("cpu")) == 1
    assert auto_micro_batch_rows(2048, torch.device("cuda")) == AUTO_MICRO_BATCH_TOKENS // 2048
    assert auto_micro_batch_rows(4 * AUTO_MICRO_BATCH_TOKENS, torch.device("cuda")) == 1
