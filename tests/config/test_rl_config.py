"""The rl config: shared keys set once and copied into each process config; devices; what the launcher writes."""

import pytest

from primerl.config import ConfigError, load
from primerl.config.rl import RLConfig
from primerl.launch.local import LaunchError, write_process_config

BASE_URL = "http://127.0.0.1:9"


def resolve(tmp_path, text: str, *overrides: str) -> RLConfig:
    path = tmp_path / "rl.toml"
    path.write_text(text)
    cfg, _ = load(RLConfig, ["@", str(path), *overrides])
    return cfg


def test_shared_keys_reach_every_process(tmp_path):
    cfg = resolve(
        tmp_path,
        """
        output_dir = "runs/x"
        seed = 7
        max_steps = 5
        max_async_steps = 0
        seq_len = 512
        [model]
        name = "tiny"
        [trainer.optim]
        lr = 3e-5
        [orchestrator.batch]
        group_size = 3
        """,
        "--inference.max_batch_size=4",
    )
    inference, orchestrator, trainer = cfg.process_configs(cfg.assign_devices(0), BASE_URL)
    assert inference.model.name == orchestrator.model.name == trainer.model.name == "tiny"
    assert orchestrator.run_dir == trainer.run_dir == cfg.output_dir
    assert inference.seed == orchestrator.seed == trainer.train.seed == 7
    assert orchestrator.max_steps == trainer.train.max_steps == 5
    assert orchestrator.max_async_steps == 0
    assert orchestrator.batch.seq_len == 512 and orchestrator.batch.group_size == 3
    assert orchestrator.client.base_url == BASE_URL
    assert trainer.optim.lr == 3e-5 and inference.max_batch_size == 4
    assert trainer.ckpt.resume is None and not orchestrator.resume


def test_resume_reaches_trainer_and_orchestrator(tmp_path):
    cfg = resolve(tmp_path, 'model.name = "tiny"\n', "--resume")
    _, orchestrator, trainer = cfg.process_configs(cfg.assign_devices(0), BASE_URL)
    assert orchestrator.resume and trainer.ckpt.resume == "latest"


@pytest.mark.parametrize("key", ["[trainer.model]\nname = 'tiny'", "[orchestrator]\nrun_dir = 'a'", "[trainer]\nrun_dir = 'a'",
                                 "[orchestrator]\nmax_async_steps = 2", "[trainer.train]\nmax_steps = 2"])
def test_a_shared_key_cannot_be_set_inside_a_section(tmp_path, key):
    with pytest.raises(ConfigError, match="unknown key"):
        resolve(tmp_path, key + "\n")


def test_process_validators_run_when_the_rl_config_is_resolved(tmp_path):
    with pytest.raises(ConfigError, match="max_off_policy_steps"):
        resolve(tmp_path, "max_async_steps = 2\n[orchestrator]\nmax_off_policy_steps = 1\n")


@pytest.mark.parametrize(
    ("num_gpus", "inference", "trainer", "colocated"),
    [
        (0, [], [], False),
        (1, [0], [0], True),
        (2, [0], [1], False),
        (4, [0], [1, 2, 3], False),
        (8, [0], [1, 2, 3, 4, 5, 6, 7], False),
    ],
)
def test_devices_are_assigned_automatically(num_gpus, inference, trainer, colocated):
    devices = RLConfig().assign_devices(num_gpus)
    assert (devices.inference, devices.trainer, devices.colocated) == (inference, trainer, colocated)
    assert devices.trainer_ranks == max(1, len(trainer))


@pytest.mark.parametrize(
    ("num_gpus", "tensor_parallel", "inference", "trainer"),
    [(1, 1, [0], [0]), (4, 2, [0, 1], [2, 3]), (8, 4, [0, 1, 2, 3], [4, 5, 6, 7]), (8, 1, [0], [1, 2, 3, 4, 5, 6, 7])],
)
def test_vllm_takes_as_many_gpus_as_its_tensor_parallel_size(tmp_path, num_gpus, tensor_parallel, inference, trainer):
    cfg = resolve(tmp_path, f'[inference]\nengine = "vllm"\nvllm.tensor_parallel_size = {tensor_parallel}\n')
    devices = cfg.assign_devices(num_gpus)
    assert (devices.inference, devices.trainer) == (inference, trainer)


@pytest.mark.parametrize(
    ("devices", "num_gpus", "inference", "trainer"),
    [
        ("trainer = [2, 3]", 4, [0], [2, 3]),  # the server gets the first GPU the trainer does not use
        ("inference = [3]", 4, [3], [0, 1, 2]),  # the trainer gets every GPU the server does not use
        ("inference = [0]\ntrainer = [0]", 1, [0], [0]),  # one shared GPU, stated explicitly
        ("trainer = [0]", 1, [0], [0]),
        ("trainer = []", 1, [0], []),  # trainer on the CPU, server on the GPU
        ("inference = []", 2, [], [0, 1]),  # server on the CPU, trainer on both GPUs
        ("inference = [1]\ntrainer = [4, 6]", 8, [1], [4, 6]),  # the others stay unused
    ],
)
def test_one_list_set_gives_the_other_the_gpus_left(tmp_path, devices, num_gpus, inference, trainer):
    cfg = resolve(tmp_path, f"[devices]\n{devices}\n")
    assigned = cfg.assign_devices(num_gpus)
    assert (assigned.inference, assigned.trainer) == (inference, trainer)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # several inference GPUs are for vLLM; the embedded engine serves from one
        ("[devices]\ninference = [0, 1]\n", "hf engine serves from one GPU.*inference.engine = 'vllm'"),
        ('[devices]\ninference = [0, 1]\n[inference]\nengine = "vllm"\nvllm.tensor_parallel_size = 1\n',
         "tensor_parallel_size = 1, but devices.inference lists 2 GPU.*must match"),
        ('[devices]\ninference = []\n[inference]\nengine = "vllm"\n', "vllm' needs a GPU.*on the CPU"),
        # overlapping lists only as one shared GPU
        ("[devices]\ninference = [0]\ntrainer = [0, 1]\n", r"share GPU\(s\) \[0\].*colocated"),
        ('[devices]\ninference = [0, 1]\ntrainer = [1, 2]\n[inference]\nengine = "vllm"\n', r"share GPU\(s\) \[1\]"),
        ("[devices]\ntrainer = [1, 1]\n", "lists a GPU twice"),
        ("[devices]\ntrainer = [-1]\n", r"names GPU\(s\) \[-1\]"),
    ],
)
def test_impossible_device_lists_fail_when_the_config_is_resolved(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        resolve(tmp_path, text)


@pytest.mark.parametrize(
    ("text", "num_gpus", "message"),
    [
        ('[inference]\nengine = "vllm"\n', 0, "vllm' needs a GPU, but this host has no GPU.*engine = 'hf'"),
        ('[inference]\nengine = "vllm"\nvllm.tensor_parallel_size = 2\n', 1, "needs 2 GPUs.*this host has 1"),
        ('[inference]\nengine = "vllm"\nvllm.tensor_parallel_size = 2\n', 2, "leaving none for the trainer"),
        ("[devices]\ntrainer = [0, 1]\n", 2, "leaving none for the inference server.*devices.inference"),
        ("[devices]\ninference = [0]\ntrainer = [1, 2]\n", 2, r"names GPU\(s\) \[2\], but this host has 2"),
        ("[devices]\ninference = [0]\n", 0, r"names GPU\(s\) \[0\], but this host has no GPU"),
    ],
)
def test_device_lists_the_host_cannot_satisfy_fail_at_assignment(tmp_path, text, num_gpus, message):
    cfg = resolve(tmp_path, text)
    with pytest.raises(ValueError, match=message):
        cfg.assign_devices(num_gpus)


def test_explicit_devices_set_the_trainer_world_size(tmp_path):
    cfg = resolve(tmp_path, "[devices]\ninference = [0]\ntrainer = [1, 2]\n")
    devices = cfg.assign_devices(3)
    _, orchestrator, _ = cfg.process_configs(devices, BASE_URL)
    assert orchestrator.batch.num_ranks == 2
    with pytest.raises(ValueError, match="GPU"):
        cfg.assign_devices(2)


def test_colocated_vllm_leaves_room_for_the_trainer(tmp_path):
    cfg = resolve(tmp_path, '[inference]\nengine = "vllm"\n')
    inference, _, _ = cfg.process_configs(cfg.assign_devices(1), BASE_URL)
    assert inference.vllm.gpu_memory_utilization < 0.5
    inference, _, _ = cfg.process_configs(cfg.assign_devices(2), BASE_URL)
    assert inference.vllm.gpu_memory_utilization == 0.9


def test_written_process_configs_read_back_identically(tmp_path):
    from primerl.config.trainer import TrainerConfig

    cfg = resolve(tmp_path, '[trainer.ckpt]\ninterval = 3\n[trainer.scheduler]\nkind = "cosine"\n')
    _, _, trainer = cfg.process_configs(cfg.assign_devices(0), BASE_URL)
    path = tmp_path / "trainer.toml"
    write_process_config(path, trainer)
    again, _ = load(TrainerConfig, ["@", str(path)])
    assert again == trainer


def test_a_none_that_toml_cannot_carry_is_refused(tmp_path):
    from primerl.config.trainer import TrainerConfig

    trainer = TrainerConfig(ckpt={"keep_last": None})
    with pytest.raises(LaunchError, match="ckpt.keep_last"):
        write_process_config(tmp_path / "trainer.toml", trainer)
