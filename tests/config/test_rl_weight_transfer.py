"""`weight_transfer` in the rl config: one key for trainer and server, one weight-group port for both, the receiver
count from the engine; standalone process configs need an explicit port."""

import pytest

from primerl.config import ConfigError, load
from primerl.config.inference import InferenceConfig
from primerl.config.rl import DeviceAssignment, RLConfig
from primerl.config.trainer import TrainerConfig

BASE_URL = "http://127.0.0.1:9"
CPU = DeviceAssignment([], [])


def resolve(*overrides: str) -> RLConfig:
    cfg, _ = load(RLConfig, ["--model.name=tiny", *overrides])
    return cfg


def test_filesystem_is_the_default_everywhere():
    inference, _, trainer = resolve().process_configs(CPU, BASE_URL)
    assert inference.weight_transfer == trainer.weights.transfer == "filesystem"


def test_broadcast_reaches_trainer_and_server_with_one_port():
    inference, _, trainer = resolve("--weight_transfer=broadcast").process_configs(CPU, BASE_URL)
    assert inference.weight_transfer == trainer.weights.transfer == "broadcast"
    group, receiver = trainer.weights.broadcast, inference.weight_broadcast
    assert group.port > 0 and receiver.port == group.port and receiver.host == group.host
    assert (receiver.init_timeout_s, receiver.timeout_s) == (group.init_timeout_s, group.timeout_s)
    assert group.receivers == 1  # the embedded engine is one receiver

    cfg = resolve("--weight_transfer=broadcast", "--trainer.weights.broadcast.timeout_s=7")
    assert cfg.process_configs(CPU, BASE_URL, broadcast_port=29123)[0].weight_broadcast.port == 29123
    inference, _, trainer = resolve("--weight_transfer=broadcast", "--trainer.weights.broadcast.port=29124",
                                    "--trainer.weights.broadcast.timeout_s=7").process_configs(CPU, BASE_URL, 29123)
    assert inference.weight_broadcast.port == trainer.weights.broadcast.port == 29124  # a configured port wins
    assert inference.weight_broadcast.timeout_s == 7


def test_a_vllm_server_has_one_receiver_per_tensor_parallel_worker():
    cfg = resolve("--weight_transfer=broadcast", "--inference.engine=vllm", "--inference.vllm.tensor_parallel_size=2")
    _, _, trainer = cfg.process_configs(DeviceAssignment([0, 1], [2]), BASE_URL)
    assert trainer.weights.broadcast.receivers == 2


@pytest.mark.parametrize("override", ["--trainer.weights.transfer=broadcast", "--trainer.weights.broadcast.receivers=2",
                                      "--inference.weight_transfer=broadcast", "--inference.weight_broadcast.port=5"])
def test_the_shared_parts_cannot_be_set_per_process(override):
    with pytest.raises(ConfigError, match="unknown key"):
        resolve(override)


def test_standalone_processes_need_the_port():
    with pytest.raises(ConfigError, match=r"weights.broadcast.port"):
        load(TrainerConfig, ["--weights.transfer=broadcast"])
    with pytest.raises(ConfigError, match=r"weight_broadcast.port"):
        load(InferenceConfig, ["--weight_transfer=broadcast"])
    cfg, _ = load(TrainerConfig, ["--weights.transfer=broadcast", "--weights.broadcast.port=29500"])
    assert cfg.weights.broadcast.port == 29500


def test_sft_refuses_the_broadcast():
    from primerl.config.sft import SFTConfig

    with pytest.raises(ConfigError, match="SFT writes its weights to the filesystem"):
        load(SFTConfig, ["--weights.transfer=broadcast", "--weights.broadcast.port=29500"])


def test_shared_needs_one_device_and_one_inference_gpu():
    inference, _, trainer = resolve("--weight_transfer=shared").process_configs(CPU, BASE_URL)
    assert inference.weight_transfer == trainer.weights.transfer == "shared"
    assert resolve("--weight_transfer=shared").assign_devices(1) == DeviceAssignment([0], [0])
    with pytest.raises(ValueError, match="needs the server and trainer rank 0 on one device"):
        resolve("--weight_transfer=shared").assign_devices(2)
    inference, _, _ = resolve("--weight_transfer=shared", "--inference.engine=vllm").process_configs(CPU, BASE_URL)
    assert (inference.engine, inference.weight_transfer) == ("vllm", "shared")
    with pytest.raises(ConfigError, match="needs inference.vllm.tensor_parallel_size = 1"):
        resolve("--weight_transfer=shared", "--inference.engine=vllm", "--inference.vllm.tensor_parallel_size=2")
