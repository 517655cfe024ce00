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
