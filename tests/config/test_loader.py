import subprocess
import sys
import textwrap

import pytest
from pydantic import Field

from primerl.config import ConfigError, ModelConfig, ProcessConfig, Section, load, read_toml, to_toml
from primerl.config.loader import parse_args


class Optim(Section):
    lr: float = 1e-5
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.99])


class Demo(ProcessConfig):
    model: ModelConfig = ModelConfig()
    optim: Optim = Optim()
    seed: int = 0
    compile: bool = False
    tags: list[str] = Field(default_factory=list)


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_files_merge_left_to_right_tables_deep_lists_replace(tmp_path):
    a = write(tmp_path / "a.toml", """
        seed = 1
        tags = ["a", "b"]
        [optim]
        lr = 0.1
        betas = [0.5, 0.5]
        """)
    b = write(tmp_path / "b.toml", """
        tags = ["c"]
        [optim]
        lr = 0.2
        """)
    cfg, _ = load(Demo, ["@", str(a), f"@{b}"])
    assert cfg.seed == 1
    assert cfg.tags == ["c"]
    assert cfg.optim.lr == 0.2
    assert cfg.optim.betas == [0.5, 0.5]


def test_include_key_is_resolved_relative_to_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "base.toml", "seed = 7\n[optim]\nlr = 0.5\n")
    top = write(tmp_path / "sub" / "top.toml", 'include = ["../base.toml"]\n[optim]\nlr = 0.25\n')
    cfg, _ = load(Demo, [str(top)])
    assert (cfg.seed, cfg.optim.lr) == (7, 0.25)


def test_include_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.toml", 'include = "b.toml"\n')
    write(tmp_path / "b.toml", 'include = "a.toml"\n')
    with pytest.raises(ConfigError, match="include cycle"):
        read_toml(tmp_path / "a.toml")


def test_cli_overrides_beat_env_beat_files(tmp_path, monkeypatch):
    f = write(tmp_path / "c.toml", "seed = 1\n[optim]\nlr = 0.1\n")
    monkeypatch.setenv("PRIMERL_OPTIM__LR", "0.3")
    monkeypatch.setenv("PRIMERL_SEED", "5")
    cfg, _ = load(Demo, [str(f), "--seed", "9"])
    assert cfg.optim.lr == 0.3  # env over file
    assert cfg.seed == 9  # CLI over env


def test_override_forms_and_flags():
    cfg, _ = load(Demo, ["--optim.lr=0.5", "--model.name", "tiny", "--compile", "--tags", '["x", "y"]'])
    assert cfg.optim.lr == 0.5 and cfg.model.name == "tiny" and cfg.compile is True and cfg.tags == ["x", "y"]
    cfg, _ = load(Demo, ["--compile", "--no-compile"])
    assert cfg.compile is False
    cfg, _ = load(Demo, ["--model.no-trust-remote-code"])
    assert cfg.model.trust_remote_code is False
    assert parse_args(["--dry-run"]).dry_run


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optim.lrr=1"], "unknown key 'optim.lrr' (from --optim.lrr); did you mean 'optim.lr'?"),
        (["--seed=abc"], "'seed': Input should be a valid integer"),
        (["--model.dtype=fp8"], "'model.dtype'"),
        (["missing.toml"], "config file not found: missing.toml"),
        (["stray"], "unexpected argument 'stray'"),
    ],
)
def test_errors_are_one_line_naming_the_key_or_file(argv, message):
    with pytest.raises(ConfigError) as info:
        load(Demo, argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_key_in_file_names_the_file(tmp_path):
    f = write(tmp_path / "bad.toml", "[optim]\nlearning_rate = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optim.learning_rate' \(from .*bad.toml\)"):
        load(Demo, [str(f)])


def test_invalid_toml_names_the_file(tmp_path):
    f = write(tmp_path / "broken.toml", "seed = = 1\n")
    with pytest.raises(ConfigError, match="broken.toml: invalid TOML"):
        load(Demo, [str(f)])


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg, _ = load(Demo, ["--seed=3", "--optim.lr=0.125"])
    out = write(tmp_path / "resolved.toml", to_toml(cfg))
    again, _ = load(Demo, [str(out)])
    assert again == cfg


def test_import_primerl_config_does_not_import_torch():
    code = "import sys, primerl.config, primerl.cli; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------------------------------
# Tables chosen by `type` (the algorithm choices): files, overrides, help, errors


def test_typed_tables_load_from_files_and_overrides_and_name_their_errors(tmp_path):
    from primerl.config.loader import is_option
    from primerl.config.rl import RLConfig

    cfg_file = write(tmp_path / "rl.toml", """
        [trainer.loss]
        type = "ppo_clip"
        clip_high = 0.3
        [orchestrator.advantage]
        type = "rloo"
        [[orchestrator.filters]]
        type = "equal_rewards"
        tolerance = 0.01
        [orchestrator.sampler]
        type = "difficulty"
        """)
    cfg, _ = load(RLConfig, ["@", str(cfg_file), "--trainer.loss.clip_low=0.1", "--orchestrator.sampler.solved_at=0.9"])
    assert (cfg.trainer.loss.type, cfg.trainer.loss.clip_low, cfg.trainer.loss.clip_high) == ("ppo_clip", 0.1, 0.3)
    assert cfg.orchestrator.advantage.type == "rloo" and cfg.orchestrator.sampler.solved_at == 0.9
    assert [(f.type, f.tolerance) for f in cfg.orchestrator.filters] == [("equal_rewards", 0.01)]
    # a recipe's stage overrides are checked against the options of every type
    assert is_option(RLConfig, "trainer.loss.type") and is_option(RLConfig, "trainer.loss.clip_high")
    assert not is_option(RLConfig, "trainer.loss.clip_hihg")
    with pytest.raises(ConfigError) as e:
        load(RLConfig, ["@", str(cfg_file), "--trainer.loss.type=gspo", "--trainer.loss.pos_ratio_low=0.1"])
    assert "unknown key 'trainer.loss.pos_ratio_low'" in str(e.value) and "(type = 'gspo')" in str(e.value)
    with pytest.raises(ConfigError, match="unknown key 'orchestrator.sampler.easy_weigth'.*did you mean "
                                         "'orchestrator.sampler.easy_weight'"):
        load(RLConfig, ["@", str(cfg_file), "--orchestrator.sampler.easy_weigth=1"])


def test_help_lists_each_type_with_its_options():
    from primerl.config.cli import field_help
    from primerl.config.trainer import TrainerConfig

    lines = field_help(TrainerConfig)
    start = next(i for i, line in enumerate(lines) if line.startswith("  [loss]"))
    assert "(default type 'masked_importance')" in lines[start]
    gspo = next(i for i, line in enumerate(lines) if line.startswith("    type = gspo:"))
    assert lines[gspo + 1].startswith("  --loss.normalize ")
    assert any(line.startswith("  --loss.clip_low  float  (default 0.0003)") for line in lines[gspo:gspo + 6])
    assert not any(line.startswith("  --loss.type ") for line in lines)


def test_base_values_keep_the_sources_they_name():
    from primerl.config.loader import Layers

    base = Layers()
    base.merge({"seed": 1, "optim": {"lr": 1e-4}}, "recipe.toml [rl]")
    base.merge({"optim": {"lr": "fast"}}, "--rl.optim.lr on the command line")
    with pytest.raises(ConfigError) as info:
        load(Demo, [], base=base)
    assert "'optim.lr'" in str(info.value) and "(from --rl.optim.lr on the command line)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load(Demo, ["--optim.lr=1e-3"], base={"seed": "x"})
    assert "'seed'" in str(info.value) and "defaults" not in str(info.value)
