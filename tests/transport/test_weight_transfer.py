"""The weight-transfer component (primerl.transport.weight_transfer): what each mode supports and refuses, the
factory, and each mode's publisher and receivers together in one process — a real tiny policy as the trainer's
weight source, the real embedded engine as the server's."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from primerl.config.common import ModelConfig
from primerl.config.trainer import BroadcastConfig, LoraConfig, TrainingConfig, WeightsConfig
from primerl.inference.engines.hf import HFEngine
from primerl.ports import free_port
from primerl.trainer.dist import DistInfo
from primerl.trainer.model import build_policy
from primerl.trainer.weights import PolicyWeights
from primerl.transport import shared, snapshots
from primerl.transport.weight_transfer.base import LoadRefused
from primerl.transport.weight_transfer.factory import PUBLISHERS, RECEIVERS, build_publisher, build_receivers
from primerl.transport.weight_transfer.modes import MODES, Unsupported, published_by, supporting, transfer_mode

FILESYSTEM, BROADCAST, SHARED = MODES["filesystem"], MODES["broadcast"], MODES["shared"]

# ---------------------------------------------------------------------------------------------------------------------
# modes: capabilities and refusals (torch-free)


def test_the_modes_import_without_torch():
    code = ("import sys, primerl.transport.weight_transfer.modes, primerl.config.rl, primerl.config.sft, "
            "primerl.launch.plan; assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_each_mode_declares_what_it_supports():
    table = {name: (m.marker, m.weight_group, m.separate_devices, m.sharded_server, m.several_hosts, m.sft,
                    m.shared_memory) for name, m in MODES.items()}
    assert table == {
        "filesystem": (None, False, True, True, True, True, False),
        "broadcast": ("BROADCAST", True, True, True, False, False, False),
        "shared": ("SHARED", False, False, False, False, False, True),
    }
    assert supporting("separate_devices") == ["filesystem", "broadcast"] and supporting("sft") == ["filesystem"]
    assert transfer_mode("shared") is SHARED
    with pytest.raises(Unsupported, match=r"^unknown weight transfer 'nccl': choose 'filesystem', 'broadcast' or "
                                          r"'shared'$"):
        transfer_mode("nccl")


def test_filesystem_refuses_nothing():
    FILESYSTEM.check_devices([0], [1, 2])
    FILESYSTEM.check_sharded_server(4)
    FILESYSTEM.check_hosts()
    FILESYSTEM.check_sft()
    FILESYSTEM.check_group_port(0, "weights.transfer", "weights.broadcast.port")


def test_broadcast_needs_its_port_and_one_host_and_is_not_for_sft():
    BROADCAST.check_devices([0], [1])
    BROADCAST.check_sharded_server(4)
    BROADCAST.check_group_port(29500, "weights.transfer", "weights.broadcast.port")
    with pytest.raises(Unsupported, match=r"^weight_transfer = 'broadcast' needs weight_broadcast.port \(the port of "
                                          r"the trainer's weight store; rl picks one itself\)$"):
        BROADCAST.check_group_port(0, "weight_transfer", "weight_broadcast.port")
    with pytest.raises(Unsupported, match=r"^rl.weight_transfer = 'broadcast': launch supports 'filesystem' \(the run "
                                          r"directory is shared\); other transfers across hosts are not wired yet$"):
        BROADCAST.check_hosts("rl.weight_transfer")
    with pytest.raises(Unsupported, match=r"^SFT writes its weights to the filesystem: weights.transfer must be "
                                          r"'filesystem'$"):
        BROADCAST.check_sft()


def test_shared_needs_one_device_and_an_unsharded_server():
    for inference, trainer in (([], []), ([0], [0]), ([0], [0, 1])):  # the CPU, or rank 0 on the server's GPU
        SHARED.check_devices(inference, trainer)
    SHARED.check_sharded_server(1)
    SHARED.check_group_port(0, "weights.transfer", "weights.broadcast.port")  # no group, no port
    with pytest.raises(Unsupported, match=r"^weight_transfer = 'shared' needs the server and trainer rank 0 on one "
                                          r"device \(the trainer's buffer lives on one device\), but inference has "
                                          r"GPUs none \(CPU\) and the trainer \[0\]; use 'filesystem' or 'broadcast' "
                                          r"for separate devices$"):
        SHARED.check_devices([], [0])
    with pytest.raises(Unsupported, match=r"GPUs \[0\] and the trainer \[1, 2\]"):
        SHARED.check_devices([0], [1, 2])
    with pytest.raises(Unsupported, match=r"^weight_transfer = 'shared' with vLLM needs "
                                          r"inference.vllm.tensor_parallel_size = 1 \(the trainer's buffer lives on "
                                          r"one device\), not 2; use 'filesystem' or 'broadcast' to feed a sharded "
                                          r"server$"):
        SHARED.check_sharded_server(2)
    with pytest.raises(Unsupported, match=r"^rl.weight_transfer = 'shared': launch supports 'filesystem'"):
        SHARED.check_hosts("rl.weight_transfer")
    with pytest.raises(Unsupported, match=r"weights.transfer must be 'filesystem'$"):
        SHARED.check_sft()


def test_a_snapshot_was_published_by_the_mode_whose_marker_it_holds(tmp_path: Path):
    plain = snapshots.staging_dir(tmp_path, 1)
    (plain / "model.safetensors").write_bytes(b"")
    assert published_by(snapshots.publish(plain, tmp_path, 1)) is FILESYSTEM
    assert published_by(snapshots.publish_marker(tmp_path, 2, snapshots.BROADCAST, {"step": 2})) is BROADCAST
    assert published_by(snapshots.publish_marker(tmp_path, 3, snapshots.SHARED, {"step": 3})) is SHARED
    assert published_by(snapshots.weights_dir(tmp_path, 1) / "model.safetensors") is FILESYSTEM  # a weights file


def test_the_factory_has_one_publisher_and_one_receiver_per_mode():
    assert set(PUBLISHERS) == set(RECEIVERS) == set(MODES)
    assert all(cls.mode is MODES[name] for table in (PUBLISHERS, RECEIVERS) for name, cls in table.items())


# ---------------------------------------------------------------------------------------------------------------------
# publishers and receivers: a real policy, the real embedded engine


@pytest.fixture(scope="module")
def policy_weights(tiny_model_dir: Path) -> PolicyWeights:
    dist, cpu = DistInfo(), torch.device("cpu")
    policy, tokenizer = build_policy(ModelConfig(name=str(tiny_model_dir)), TrainingConfig(device="cpu"),
                                     LoraConfig(), cpu, dist)
    return PolicyWeights(policy, tokenizer, torch.float32, dist, cpu)


def new_version(source: PolicyWeights) -> None:
    """What an optimizer step does, as far as the export sees it: every parameter changes."""
    with torch.no_grad():
        for param in source.policy.parameters():
            param.add_(0.01)


def serves_the_policy(engine: HFEngine, source: PolicyWeights) -> bool:
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    specs = source.specs()
    (tensors,) = source.gather([[spec.name for spec in specs]])
    pairs = zip(specs, tensors, strict=True)
    return all(torch.equal(params[spec.name], tensor.to(params[spec.name].dtype)) for spec, tensor in pairs)


def serve(tiny_model_dir: Path, mode: str, scenario) -> None:
    """Run `scenario(engine, receivers)` against the started embedded engine and the receivers of `mode`."""
    async def main() -> None:
        engine = HFEngine(tiny_model_dir, model_name="tiny", max_batch_size=2, decode_steps=1)
        await engine.start()
        try:
            await scenario(engine, build_receivers(mode, engine, group=None))
        finally:
            await engine.stop()

    asyncio.run(main())


def test_filesystem_publishes_full_snapshots_that_the_receiver_loads_once(
    tiny_model_dir: Path, policy_weights: PolicyWeights, tmp_path: Path, caplog
):
    publisher = build_publisher(WeightsConfig(transfer="filesystem", keep_last=2), policy_weights, tmp_path)
    new_version(policy_weights)
    metrics = publisher.publish(1, is_last=False, also_full=False)
    assert metrics["weight_transfer"] == "filesystem" and metrics["weights_export_s"] > 0
    step_1 = snapshots.weights_dir(tmp_path, 1)
    assert snapshots.is_stable(step_1) and snapshots.has_files(step_1)

    async def scenario(engine: HFEngine, receivers) -> None:
        await receivers.load(step_1, 1, str(step_1))
        assert engine.policy_version == 1 and serves_the_policy(engine, policy_weights)
        with caplog.at_level(logging.INFO, logger="primerl.transport.weight_transfer"):
            await receivers.load(step_1, 1, str(step_1))  # a retried request
        assert f"weights: step 1 from {step_1} is already live" in caplog.text
        with pytest.raises(LoadRefused, match="no weights at /nowhere") as refused:
            await receivers.load(Path("/nowhere"), 2, "/nowhere")
        assert refused.value.code == "weights_not_found" and engine.policy_version == 1

    serve(tiny_model_dir, "filesystem", scenario)
    for step in (2, 3):
        publisher.publish(step, is_last=step == 3, also_full=False)
    assert snapshots.stable_steps(tmp_path) == [2, 3]  # keep_last = 2


def test_shared_hands_versions_over_the_buffer_and_falls_back_when_the_server_is_silent(
    tiny_model_dir: Path, policy_weights: PolicyWeights, tmp_path: Path
):
    settings = WeightsConfig(transfer="shared", keep_last=None, shared_timeout_s=0.2)
    publisher = build_publisher(settings, policy_weights, tmp_path)
    try:
        new_version(policy_weights)
        metrics = publisher.publish(1, is_last=False, also_full=False)
        step_1 = snapshots.weights_dir(tmp_path, 1)
        assert metrics["weight_transfer"] == "shared" and "weights_export_s" not in metrics
        assert snapshots.marker(step_1, snapshots.SHARED) and not snapshots.has_files(step_1)

        async def scenario(engine: HFEngine, receivers) -> None:
            await receivers.load(step_1, 1, str(step_1))
            assert engine.policy_version == 1 and serves_the_policy(engine, policy_weights)
            assert shared.read_applied(tmp_path) == 1  # frees the trainer to overwrite the buffer

        serve(tiny_model_dir, "filesystem", scenario)  # the marker decides, whatever the server's mode
        step_2 = snapshots.weights_dir(tmp_path, 2)
        assert publisher.publish(2, is_last=False, also_full=True)["weights_export_s"] > 0  # a checkpoint step
        assert snapshots.has_files(step_2) and snapshots.marker(step_2, snapshots.SHARED) is None
        publisher.publish(3, is_last=False, also_full=False)  # in the buffer; nobody applies it
        metrics = publisher.publish(4, is_last=False, also_full=False)
        assert metrics["weight_transfer"] == ("filesystem (fallback: inference did not apply shared weights step 3 "
                                              "within 0s)")
        assert snapshots.has_files(snapshots.weights_dir(tmp_path, 4)) and publisher.segment is None
    finally:
        publisher.close()


def test_broadcast_without_receivers_falls_back_to_the_filesystem(policy_weights: PolicyWeights, tmp_path: Path):
    group = BroadcastConfig(port=free_port("127.0.0.1"), init_timeout_s=1, timeout_s=1)
    publisher = build_publisher(WeightsConfig(transfer="broadcast", broadcast=group), policy_weights, tmp_path)
    assert not publisher.sending
    metrics = publisher.publish(1, is_last=False, also_full=False)
    assert metrics["weight_transfer"].startswith("filesystem (fallback: receiver rank(s) [1] of 1 did not join")
    assert snapshots.has_files(snapshots.weights_dir(tmp_path, 1))


def test_the_broadcast_receiver_confirms_what_it_holds_and_refuses_what_it_never_got(
    tiny_model_dir: Path, policy_weights: PolicyWeights, tmp_path: Path
):
    build_publisher(WeightsConfig(), policy_weights, tmp_path).publish(3, is_last=False, also_full=False)
    full_3 = snapshots.weights_dir(tmp_path, 3)
    marker_2 = snapshots.publish_marker(tmp_path, 2, snapshots.BROADCAST, {"step": 2, "transfer_id": "t-2"})
    marker_5 = snapshots.publish_marker(tmp_path, 5, snapshots.BROADCAST, {"step": 5, "transfer_id": "t-5"})

    async def scenario(engine: HFEngine, receivers) -> None:
        await receivers.load(full_3, 3, str(full_3))
        await receivers.load(marker_2, 2, str(marker_2))  # an older version the engine is past: confirmed
        assert engine.policy_version == 3
        with pytest.raises(LoadRefused, match=r"weights step 5 were broadcast .*\(it serves policy version 3; "
                                              r"weight receiver: off\)") as refused:
            await receivers.load(marker_5, 5, str(marker_5))
        assert refused.value.code == "weights_not_received" and engine.policy_version == 3

    serve(tiny_model_dir, "broadcast", scenario)


def test_a_resumed_run_writes_its_checkpoint_version_in_full_when_markers_are_left(
    policy_weights: PolicyWeights, tmp_path: Path
):
    """A run that used the shared buffer resumes with the filesystem: the restarted server holds nothing that was
    shared, so version `step` goes to disk, and newer snapshots go."""
    for step in (1, 2):
        snapshots.publish_marker(tmp_path, step, snapshots.SHARED, {"step": step, "segment_id": "gone"})
    build_publisher(WeightsConfig(), policy_weights, tmp_path).resumed(1)
    assert snapshots.stable_steps(tmp_path) == [1]
    assert snapshots.has_files(snapshots.weights_dir(tmp_path, 1))
