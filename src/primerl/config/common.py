"""Config sections shared by several processes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from primerl.config.base import Section

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class ModelConfig(Section):
    """Which model to load. `name` is a registry name (`smollm2-135m-instruct`, `tiny`), a local directory, or a hub
    id (`Qwen/Qwen3-0.6B`) that must already be in the local hub cache at `revision`."""

    name: str = Field("smollm2-135m-instruct", description="registry name, local directory or hub id")
    revision: str | None = Field(None, description="hub commit for hub ids (pinned by recipes)")
    dtype: Dtype = Field("auto", description="auto = bfloat16 on GPU, float32 on CPU")
    trust_remote_code: bool = Field(False, description="allow custom modelling code from the model directory")


class WandbConfig(Section):
    """Weights & Biases logging, off unless `project` is set. Every process of one run directory logs to one W&B run
    (an `rl` run's trainer and orchestrator share it), whose config is the recipe's manifest when there is one."""

    project: str | None = Field(None, description="W&B project; unset: no W&B logging")
    entity: str | None = Field(None, description="W&B team or user (default: the API key's default entity)")
    name: str | None = Field(None, description="display name of the W&B run (default: the run directory's name)")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="offline: write the W&B run under <run>/wandb/ only (upload later with `wandb sync`)"
    )
