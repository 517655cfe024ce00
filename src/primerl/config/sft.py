"""Config of the SFT trainer (`primerl sft`). The training sections are the RL trainer's (primerl.config.trainer)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from primerl.config.base import ProcessConfig, Section
from primerl.config.common import ModelConfig, WandbConfig
from primerl.config.trainer import (
    CheckpointConfig,
    LoraConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
    WeightsConfig,
    check_schedule,
)
from primerl.transport.weight_transfer.modes import transfer_mode


class SFTDataConfig(Section):
    """Chat conversations: a JSONL file (one {"messages": [...]} per line) or a `datasets` file / saved dataset."""

    path: str | None = Field(None, description=".jsonl, .json, .parquet, .arrow file, or a datasets.save_to_disk dir")
    messages_field: str = Field("messages", description="the column holding the list of {role, content} messages")
    seq_len: int = Field(1024, ge=8, description="packed row length in tokens (longer conversations are cut)")
    rows_per_step: int = Field(4, ge=1, description="packed rows per optimizer step, over all ranks")
    shuffle: bool = Field(True, description="shuffle the packed rows each epoch (seeded by train.seed)")
    fake: bool = Field(False, description="generate a word-reversal chat dataset instead of reading `path`")
    fake_conversations: int = Field(256, ge=1, description="fake mode: number of conversations")

    @model_validator(mode="after")
    def _needs_source(self) -> SFTDataConfig:
        if not self.fake and not self.path:
            raise ValueError("set data.path to a dataset file, or data.fake = true")
        return self


class SFTConfig(ProcessConfig):
    """Supervised fine-tuning on chat data, loss on assistant tokens only; writes weights and checkpoints."""

    run_dir: Path = Field(Path("runs/sft"), description="run directory (metrics, checkpoints, weights)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the model to fine-tune")
    train: TrainingConfig = Field(default_factory=TrainingConfig, description="steps (None: one epoch), kernels")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters")
    optim: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(lr=1e-5), description="AdamW")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="learning-rate schedule")
    data: SFTDataConfig = Field(default_factory=lambda: SFTDataConfig(fake=True), description="conversations")
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    weights: WeightsConfig = Field(
        default_factory=lambda: WeightsConfig(interval=None), description="weight export (default: at the end)"
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging (off by default)")

    @model_validator(mode="after")
    def _decay_needs_length(self) -> SFTConfig:
        check_schedule(self.scheduler, self.train)
        transfer_mode(self.weights.transfer).check_sft()
        return self
