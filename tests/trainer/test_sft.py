"""SFT: assistant-only loss mask through the chat template, data files, the loss going down on the tiny model, and the
fake debug configs on the embedded SmolLM2 (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import read_metrics

from primerl.config import load
from primerl.config.sft import SFTConfig, SFTDataConfig
from primerl.trainer.sft import fake_conversations, load_conversations, tokenize_conversation, train
from primerl.transport import snapshots

REPO = Path(__file__).resolve().parents[2]

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "second answer"},
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from primerl.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny"))


def test_mask_covers_assistant_turns_only(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION)
    assert len(ids) == len(mask)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    assert runs == ["first answer<|im_end|>\n", "second answer<|im_end|>\n"]


def test_reads_jsonl_and_datasets_files(tmp_path):
    records = [{"messages": c} for c in fake_conversations(5, seed=1)]
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    import datasets

    parquet = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(records).to_parquet(str(parquet))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    for path in (jsonl, parquet, saved):
        assert load_conversations(SFTDataConfig(path=str(path)), seed=0) == [r["messages"] for r in records]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no messages"}) + "\n")
    with pytest.raises(ValueError, match="messages"):
        load_conversations(SFTDataConfig(path=str(bad)), seed=0)


@pytest.mark.integration
def test_sft_lowers_the_loss_on_a_fixed_dataset(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in fake_conversations(96, seed=3)))
    cfg, _ = load(
        SFTConfig,
        [
            "--model.name",
            "tiny",
            "--run_dir",
            str(tmp_path / "run"),
            "--data.path",
            str(data),
            "--data.seq_len",
            "128",
            "--data.rows_per_step",
            "4",
            "--train.max_steps",
            "16",
            "--train.micro_batch_rows",
            "2",
            "--optim.lr",
            "3e-3",
            "--scheduler.kind",
            "cosine",
            "--scheduler.warmup_steps",
            "2",
        ],
    )
    train(cfg)
    metrics = read_metrics(tmp_path / "run", source="sft")
    assert sorted(metrics) == list(range(1, 17))
    first = (metrics[1]["loss"] + metrics[2]["loss"]) / 2
    last = (metrics[15]["loss"] + metrics[16]["loss"]) / 2
    assert last < 0.7 * first, (first, last)
    assert metrics[1]["epoch"] == 0 and metrics[16]["epoch"] >= 1  # the small set is seen more than once
    assert snapshots.stable_steps(tmp_path / "run") == [16]


def run_cli(args, run_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "primerl.cli", *args, "--run_dir", str(run_dir)]
    done = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
def test_fake_sft_config_runs_on_smollm2(tmp_path):
    run_cli(["sft", "@", "configs/debug/fake/sft.toml"], tmp_path)
    metrics = read_metrics(tmp_path, source="sft")
    assert sorted(metrics) == [1, 2, 3] and all(m["loss"] > 0 for m in metrics.values())
    assert snapshots.stable_steps(tmp_path) == [3]


@pytest.mark.slow
def test_fake_rl_config_runs_on_smollm2(tmp_path):
    run_cli(["trainer", "@", "configs/debug/fake/rl.toml"], tmp_path)
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == [1, 2, 3]
    assert metrics[1]["mismatch_kl"] == pytest.approx(0, abs=1e-6)  # fake data is on-policy at the first step
    assert snapshots.stable_steps(tmp_path) == [3]
