"""Config of `primerl eval`: an environment, a model (served here or already running), k rollouts per task."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from primerl.config.base import ProcessConfig
from primerl.config.common import ModelConfig, WandbConfig
from primerl.config.inference import InferenceConfig
from primerl.config.orchestrator import EnvSection, SamplingSection
from primerl.config.rl import section_of

EvalInferenceSection = section_of(
    InferenceConfig, {"model", "seed", "admin_token", "admin_token_file"}, "EvalInferenceSection", defaults={"port": 0}
)


class EvalConfig(ProcessConfig):
    """Evaluate a model on an environment: k rollouts per task, avg@k and pass@k, results as JSON."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="the model (served here unless base_url)")
    base_url: str | None = Field(
        None, description="evaluate against this running OpenAI-compatible server instead of starting one"
    )
    served_model_name: str | None = Field(None, description="model name the server expects (default: model.name)")
    client: Literal["chat", "token"] = Field(
        "chat", description="chat = /v1/chat/completions (any server); token = /inference/v1/generate (primerl, vLLM)"
    )
    env: EnvSection = Field(default_factory=EnvSection, description="environment")
    num_examples: int = Field(16, ge=1, description="tasks to evaluate (all of them if the environment has fewer)")
    rollouts_per_example: int = Field(4, ge=1, description="k: rollouts per task")
    pass_threshold: float = Field(1.0, description="a rollout passes when its reward is at least this")
    sampling: SamplingSection = Field(default_factory=SamplingSection, description="sampling")
    max_concurrent: int = Field(64, ge=1, description="rollouts in flight at most")
    seed: int = Field(0, description="seed of the task selection")
    output_dir: Path = Field(Path("runs/eval"), description="results.json (and the server's log) go here")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging (off by default)")
    startup_timeout_s: float = Field(900.0, gt=0, description="wait this long for a started server to be healthy")
    inference: EvalInferenceSection = Field(
        default_factory=EvalInferenceSection, description="the server eval starts when base_url is not set"
    )
