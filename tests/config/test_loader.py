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
