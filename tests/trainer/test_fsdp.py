"""FSDP2 on CPU: a 2-rank gloo run (torchrun) matches a 1-rank run on the same batches, and its checkpoint resumes
on 1 rank with the same next step as the uninterrupted 1-rank run (DCP reshards)."""

import os
import subprocess
import sys

import pytest
from trainer_helpers import read_metrics, write_fixed_batches

from primerl.config import load
from primerl.config.trainer import TrainerConfig
from primerl.trainer.rl import train

pytestmark = pytest.mark.integration

ARGS = [
    "--model.name",
    "tiny",
    "--train.backward_dtype",  # float32 gradients: sharded, resumed and plain runs agree to float32's rounding
    "float32",
    "--optim.lr",
    "1e-3",
    "--data.poll_interval_s",
    "0.05",
    "--loss.kwargs",
    '{"kl_coef": 0.05}',
]
# float32 sums in another order (sharded reductions), then one Adam step, which amplifies tiny gradient differences
KEYS = ("loss", "grad_norm", "entropy", "mismatch_kl", "masked_fraction", "num_loss_tokens")


def test_two_ranks_match_one_rank_and_resume_on_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for run in (one, two):
        write_fixed_batches(run, range(3), num_ranks=2)

    cfg, _ = load(TrainerConfig, [*ARGS, "--run_dir", str(one), "--train.max_steps", "3"])
    train(cfg)
    expected = read_metrics(one)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "primerl.trainer.rl",
        *ARGS,
        "--run_dir",
        str(two),
        "--train.max_steps",
        "2",
    ]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "device cpu x2" in done.stderr
    sharded = read_metrics(two)
    for step in (1, 2):
        for key in KEYS:
            assert sharded[step][key] == pytest.approx(expected[step][key], rel=1e-4, abs=1e-5), (step, key)

    cfg, _ = load(TrainerConfig, [*ARGS, "--run_dir", str(two), "--train.max_steps", "3", "--ckpt.resume", "2"])
    train(cfg)
    resumed = read_metrics(two)[3]
    for key in KEYS:
        assert resumed[key] == pytest.approx(expected[3][key], rel=1e-4, abs=1e-5), key
