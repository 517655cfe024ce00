"""primerl's configuration: typed pydantic-settings models per process, TOML files with includes, env, CLI overrides.

`import primerl.config` never imports torch.
"""

from primerl.config.base import ProcessConfig, Section
from primerl.config.cli import config_from_argv
from primerl.config.common import ModelConfig
from primerl.config.loader import ConfigError, load, read_toml, to_toml

__all__ = ["ConfigError", "ModelConfig", "ProcessConfig", "Section", "config_from_argv", "load", "read_toml", "to_toml"]
