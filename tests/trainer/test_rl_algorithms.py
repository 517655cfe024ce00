"""The loss choices inside the real trainer on the tiny model: the default equals the loss configs were written with
before losses had a type, every built-in trains, the sequence normalisation does not depend on how a step is split,
and the reference KL is computed by the trainer from a frozen copy of the initial model."""

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import read_metrics, write_fixed_batches

from primerl.config import load
from primerl.config.trainer import TrainerConfig
from primerl.trainer.rl import train
from primerl.transport import snapshots

pytestmark = pytest.mark.integration

BASE = ["--model.name", "tiny", "--optim.lr", "1e-3", "--data.poll_interval_s", "0.05", "--train.backward_dtype",
        "float32"]


def run(run_dir, *extra, steps: int = 2) -> dict[int, dict]:
    write_fixed_batches(run_dir, range(steps), seq_len=32)
    cfg, _ = load(TrainerConfig, [*BASE, "--run_dir", str(run_dir), "--train.max_steps", str(steps), *extra])
    train(cfg)
    return read_metrics(run_dir)


def final_weights(run_dir, step: int = 2) -> dict[str, torch.Tensor]:
    return load_file(snapshots.weights_dir(run_dir, step) / "model.safetensors")


def test_the_default_loss_trains_exactly_as_the_path_configs_did(tmp_path):
    typed = run(tmp_path / "typed")
    legacy = run(tmp_path / "legacy", "--loss.path", "primerl.trainer.loss:masked_importance_loss")
    for step in (1, 2):
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl", "masked_fraction"):
            assert typed[step][key] == legacy[step][key], (step, key)
    a, b = final_weights(tmp_path / "typed"), final_weights(tmp_path / "legacy")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("loss", [
    ["--loss.type", "ppo_clip", "--loss.clip_high", "0.3"],
    ["--loss.type", "gspo"],
    ["--loss.type", "cispo", "--loss.normalize", "constant", "--loss.normalize_tokens", "24"],
])
def test_every_builtin_loss_trains(tmp_path, loss):
    metrics = run(tmp_path, *loss)
    initial = final_weights(tmp_path, 1)
    assert all(m["loss"] == m["loss"] and m["grad_norm"] > 0 for m in metrics.values())
    assert any(not torch.equal(initial[k], v) for k, v in final_weights(tmp_path).items())


def test_sequence_normalisation_is_independent_of_the_micro_batch_split(tmp_path):
    loss = ["--loss.type", "ppo_clip", "--loss.normalize", "sequence"]
    a = run(tmp_path / "a", *loss, "--train.micro_batch_rows", "8", steps=1)[1]
    b = run(tmp_path / "b", *loss, "--train.micro_batch_rows", "1", steps=1)[1]
    token = run(tmp_path / "token", "--loss.type", "ppo_clip", steps=1)[1]
    for key in ("loss", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert a["grad_norm"] != pytest.approx(token["grad_norm"], rel=1e-3)  # the weights do change the step


def test_reference_kl_is_zero_before_the_first_update_and_then_grows(tmp_path):
    metrics = run(tmp_path / "kl", "--reference.kl_coef", "0.5", steps=3)
    plain = run(tmp_path / "plain", steps=3)
    assert metrics[1]["ref_kl"] == 0.0  # the reference is the initial model: identical log-probs
    assert metrics[1]["loss"] == plain[1]["loss"]
    assert metrics[2]["ref_kl"] > 0 and metrics[3]["ref_kl"] > 0  # the policy moved away from it
    assert metrics[3]["loss"] != plain[3]["loss"]
    assert "ref_kl" not in plain[2]
