"""Weight broadcast (primerl.transport.broadcast and the trainer's publisher): buckets, real sender and receiver
processes over gloo, timeouts instead of hangs, the filesystem fallback, and a 2-rank FSDP2 trainer whose broadcast
equals what it writes to disk."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import read_metrics, write_fixed_batches

from primerl.config import load
from primerl.config.trainer import TrainerConfig
from primerl.trainer.rl import train
from primerl.transport import snapshots
from primerl.transport.broadcast import BroadcastSender, GroupFormationError, TransferStats, WeightTransferError
from primerl.transport.buckets import ALIGN_BYTES, Manifest, TensorSpec, pack_bucket, plan_buckets, unpack_bucket

PEER = Path(__file__).with_name("broadcast_peer.py")


def sample_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g).bfloat16(),  # 2 KiB
        "big.weight": torch.randn(40, 40, generator=g),  # 6400 B: more than a 4 KiB bucket, travels alone
        "norm.weight": torch.randn(16, generator=g).half(),
        "positions": torch.randint(-5, 1000, (7,), generator=g),  # int64
        "flags": torch.rand(5, generator=g) > 0.5,  # bool
        "scale": torch.tensor(float(seed) + 0.5),  # 0-d
        "empty": torch.zeros(0, 3),
    }


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def send(sender: BroadcastSender, step: int, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> TransferStats:
    manifest = plan_buckets(specs_of(tensors), bucket_bytes)
    sender.begin(step, manifest)
    for index, bucket in enumerate(manifest.buckets):
        sender.send_bucket(index, [tensors[entry.name] for entry in bucket.tensors])
    return sender.end()


def start_peer(port: int, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PEER), str(port), str(out), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


# ---------------------------------------------------------------------------------------------------------------------
# buckets (no processes)


def test_buckets_round_trip_every_dtype_and_a_tensor_bigger_than_a_bucket():
    tensors = sample_tensors(0)
    manifest = plan_buckets(specs_of(tensors), bucket_bytes=4096)
    assert [e.name for e in manifest.entries()] == list(tensors)  # send order = given order
    big = next(b for b in manifest.buckets if any(e.name == "big.weight" for e in b.tensors))
    assert [e.name for e in big.tensors] == ["big.weight"] and big.num_bytes == 6400
    for bucket in manifest.buckets:
        assert bucket.num_bytes <= 4096 or len(bucket.tensors) == 1
        assert all(e.offset % ALIGN_BYTES == 0 for e in bucket.tensors)
    assert manifest.num_bytes == sum(b.num_bytes for b in manifest.buckets)
    assert manifest.summary()["dtypes"] == {"bfloat16": 1, "bool": 1, "float16": 1, "float32": 3, "int64": 1}

    received = {}
    for bucket in manifest.buckets:
        buffer = torch.full((bucket.num_bytes,), 255, dtype=torch.uint8)
        pack_bucket(bucket, [tensors[e.name] for e in bucket.tensors], buffer)
        received.update(unpack_bucket(bucket, buffer.clone()))
    assert list(received) == list(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name


def test_manifest_is_deterministic_and_survives_json():
    first = plan_buckets(specs_of(sample_tensors(0)), bucket_bytes=4096)
    again = plan_buckets(specs_of(sample_tensors(1)), bucket_bytes=4096)  # other values, same specs
    assert first.to_json() == again.to_json()
    assert Manifest.from_json(first.to_json()) == first
    assert len(plan_buckets(specs_of(sample_tensors(0)), bucket_bytes=1 << 20).buckets) == 1  # all fit in one
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([TensorSpec("a", torch.float32, (2,)), TensorSpec("a", torch.float32, (2,))], 64)
    bucket = first.buckets[0]
    with pytest.raises(ValueError, match="shape"):
        pack_bucket(bucket, [torch.zeros(1)] * len(bucket.tensors), torch.empty(bucket.num_bytes, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------------------------------
# a sender here, a receiver process there (gloo on the CPU)


def test_receiver_process_gets_every_tensor_exactly(tmp_path: Path, port: int):
    steps = {1: sample_tensors(1), 2: sample_tensors(2)}
    peer = start_peer(port, tmp_path, "--transfers", "2")
    sender = BroadcastSender("127.0.0.1", port, receivers=1, init_timeout_s=120, timeout_s=60)
    try:
        sender.form()
        assert sender.backend == "gloo"
        for step, tensors in steps.items():
            stats = send(sender, step, tensors, bucket_bytes=4096)
            assert stats.step == step and stats.num_tensors == len(tensors) and stats.num_buckets >= 3
            assert stats.transfer_id == f"{sender.group_id}-{step}"
    finally:
        sender.close()
    out, _ = peer.communicate(timeout=60)
    assert peer.returncode == 0, out
    for step, tensors in steps.items():
        received = load_file(tmp_path / f"step_{step}.safetensors")
        assert sorted(received) == sorted(tensors)
        for name, tensor in tensors.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), (step, name)


def test_a_receiver_that_never_answers_fails_the_transfer_within_the_timeout(tmp_path: Path, port: int):
    peer = start_peer(port, tmp_path, "--join-only")
    sender = BroadcastSender("127.0.0.1", port, receivers=1, init_timeout_s=120, timeout_s=2)
    try:
        sender.form()
        peer.wait(timeout=60)  # joined, then gone
        started = time.monotonic()
        with pytest.raises(WeightTransferError, match=r"weights step 1: no 'ready' from receiver rank\(s\) \[1\] "
                                                      r"within 2s"):
            send(sender, 1, sample_tensors(1), bucket_bytes=4096)
        assert time.monotonic() - started < 4
    finally:
        sender.close()


def test_the_group_does_not_form_without_receivers_or_on_a_taken_port(port: int):
    sender = BroadcastSender("127.0.0.1", port, receivers=2, init_timeout_s=2, timeout_s=2)
    started = time.monotonic()
    with pytest.raises(GroupFormationError, match=r"receiver rank\(s\) \[1, 2\] of 2 did not join within 2s"):
        sender.form()
    assert time.monotonic() - started < 4
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = BroadcastSender("127.0.0.1", taken.getsockname()[1], receivers=1, init_timeout_s=2, timeout_s=2)
        with pytest.raises(GroupFormationError, match="cannot host the weight store"):
            busy.form()


# ---------------------------------------------------------------------------------------------------------------------
# the trainer


def test_trainer_falls_back_to_the_filesystem_when_no_receiver_joins(tmp_path: Path, port: int, caplog):
    cfg, _ = load(TrainerConfig, [
        "--model.name", "tiny", "--data.fake", "--train.max_steps", "2", "--run_dir", str(tmp_path),
        "--weights.transfer", "broadcast", "--weights.broadcast.port", str(port),
        "--weights.broadcast.init_timeout_s", "2",
    ])
    with caplog.at_level(logging.WARNING, logger="primerl.transport.weight_transfer"):
        train(cfg)
    assert "WEIGHT BROADCAST UNAVAILABLE" in caplog.text
    metrics = read_metrics(tmp_path)
    for step in (1, 2):
        assert metrics[step]["weight_transfer"].startswith(
            "filesystem (fallback: receiver rank(s) [1] of 1 did not join within 2s"), metrics[step]
        path = snapshots.weights_dir(tmp_path, step)
        assert snapshots.is_stable(path) and snapshots.has_files(path)
        assert snapshots.marker(path, snapshots.BROADCAST) is None


def test_a_resumed_broadcast_run_drops_newer_snapshots_and_writes_its_checkpoint_version(tmp_path: Path, port: int):
    base = ["--model.name", "tiny", "--data.fake", "--run_dir", str(tmp_path), "--train.max_steps", "2",
            "--ckpt.interval", "1"]
    train(load(TrainerConfig, base)[0])
    trained = load_file(snapshots.weights_dir(tmp_path, 2) / "model.safetensors")
    for step in (2, 3):  # what a broadcast run can leave behind: versions that only the dead server held
        shutil.rmtree(snapshots.weights_dir(tmp_path, step), ignore_errors=True)
        staged = snapshots.staging_dir(tmp_path, step)
        snapshots.write_marker(staged, snapshots.BROADCAST, {"step": step, "transfer_id": "gone"})
        snapshots.publish(staged, tmp_path, step)

    train(load(TrainerConfig, [*base, "--ckpt.resume", "latest", "--weights.transfer", "broadcast",
                               "--weights.broadcast.port", str(port), "--weights.broadcast.init_timeout_s", "1"])[0])
    assert snapshots.stable_steps(tmp_path) == [1, 2]  # step 3 will be trained (and sent) again
    rewritten = snapshots.weights_dir(tmp_path, 2)
    assert snapshots.has_files(rewritten) and snapshots.marker(rewritten, snapshots.BROADCAST) is None
    again = load_file(rewritten / "model.safetensors")  # the checkpoint's weights, not the initial ones
    assert sorted(again) == sorted(trained) and all(torch.equal(again[k], trained[k]) for k in trained)


FSDP_ARGS = ["--model.name", "tiny", "--optim.lr", "1e-3", "--data.poll_interval_s", "0.05"]


@pytest.mark.integration
def test_two_rank_fsdp_trainer_broadcasts_exactly_what_it_exports(tmp_path: Path, port: int, tiny_model_dir: Path):
    run, received_dir = tmp_path / "run", tmp_path / "received"
    write_fixed_batches(run, range(3), num_ranks=2)
    peer = start_peer(port, received_dir, "--transfers", "2")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
        "primerl.trainer.rl", *FSDP_ARGS, "--run_dir", str(run), "--train.max_steps", "3", "--ckpt.interval", "2",
        "--weights.transfer", "broadcast", "--weights.broadcast.port", str(port),
        "--weights.broadcast.bucket_mb", "1",
    ]
    done = subprocess.run(cmd, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    out, _ = peer.communicate(timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert peer.returncode == 0, out

    # step 1: broadcast only (a marker); step 2: broadcast and, as a checkpoint step, written in full; step 3: last
    step_1, step_2, step_3 = (snapshots.weights_dir(run, step) for step in (1, 2, 3))
    assert snapshots.marker(step_1, snapshots.BROADCAST) and not snapshots.has_files(step_1)
    marker = snapshots.marker(step_2, snapshots.BROADCAST)
    assert marker and snapshots.has_files(step_2)
    assert snapshots.marker(step_3, snapshots.BROADCAST) is None and snapshots.has_files(step_3)

    received = load_file(received_dir / "step_2.safetensors")
    exported = load_file(snapshots.weights_dir(run, 2) / "model.safetensors")  # gathered by get_model_state_dict
    assert sorted(received) == sorted(exported)
    for name, tensor in exported.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    assert marker["num_tensors"] == len(received) and marker["num_buckets"] >= 2
    assert marker["num_bytes"] == sum(t.numel() * t.element_size() for t in received.values())

    # the same tensors, names and shapes as the one-rank model's own state dict (the tied head once)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    reference.pop("lm_head.weight")
    assert {k: tuple(v.shape) for k, v in received.items()} == {k: tuple(v.shape) for k, v in reference.items()}
    moved = [k for k, v in received.items() if not torch.equal(v, reference[k].to(v.dtype))]
    assert moved, "step 2 weights equal the initial ones"

    metrics = read_metrics(run)
    assert [metrics[s]["weight_transfer"] for s in (1, 2, 3)] == ["broadcast"] * 3
    assert metrics[1]["weights_broadcast_bytes"] == marker["num_bytes"] and metrics[1]["weights_broadcast_s"] > 0
    assert "weights_broadcast_s" not in metrics[3] and metrics[3]["weights_export_s"] > 0
