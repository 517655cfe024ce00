"""Config of `rl`: one file for a whole run. Keys the three processes share are set once at the top level and copied
into each process's config; the `[inference]`, `[orchestrator]` and `[trainer]` tables hold everything else.

    model.name = "smollm2-135m-instruct"   # -> inference.model, orchestrator.model, trainer.model
    output_dir = "runs/reverse-text"        # -> orchestrator.run_dir, trainer.run_dir (the run directory)
    seed = 0                                # -> inference.seed, orchestrator.seed, trainer.train.seed
    max_steps = 20                          # -> orchestrator.max_steps, trainer.train.max_steps
    max_async_steps = 1                     # -> orchestrator.max_async_steps
    seq_len = 2048                          # -> orchestrator.batch.seq_len (the trainer reads it from each batch)

A shared key cannot be set again inside a section (it is not a key of the section at all), so a run never has two
models or two run directories. The launcher fills in what only it knows: the server's URL and admin token, the trainer's
data-parallel size (from `devices`) and `--resume`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
from pydantic import Field, create_model, model_validator

from primerl.config.base import ProcessConfig, Section
from primerl.config.common import ModelConfig
from primerl.config.inference import InferenceConfig
from primerl.config.loader import FILE_LAYER
from primerl.config.orchestrator import OrchestratorConfig
from primerl.config.trainer import TrainerConfig

# Dotted keys of each process config that the rl config sets from its top level (or the launcher sets).
INFERENCE_SHARED = {"model", "seed", "admin_token", "admin_token_file"}
ORCHESTRATOR_SHARED = {
    "run_dir", "model", "served_model_name", "seed", "max_steps", "max_async_steps", "resume", "admin_token",
    "client.base_url", "batch.seq_len", "batch.num_ranks",
}
TRAINER_SHARED = {"run_dir", "model", "train.max_steps", "train.seed", "ckpt.resume"}


def section_of(config: type[pydantic.BaseModel], exclude: set[str], name: str,
               defaults: dict[str, Any] | None = None) -> type[Section]:
    """A `Section` with the fields of `config` minus the dotted keys in `exclude` (nested tables are rebuilt without
    theirs), and `defaults` replacing field defaults. Field descriptions carry over, so `rl --help` documents them."""
    defaults = defaults or {}
    fields: dict[str, Any] = {}
    for field_name, info in config.model_fields.items():
        if field_name in exclude:
            continue
        nested_exclude = {k.split(".", 1)[1] for k in exclude if k.startswith(field_name + ".")}
        info = copy.copy(info)
        annotation = info.annotation
        if nested_exclude:
            annotation = section_of(annotation, nested_exclude, f"{name}{field_name.title()}")
            info = Field(default_factory=annotation, description=info.description)
        elif field_name in defaults:
            info = Field(defaults[field_name], description=info.description)
        fields[field_name] = (annotation, info)
    return create_model(name, __base__=Section, __doc__=config.__doc__, **fields)


InferenceSection = section_of(
    InferenceConfig, INFERENCE_SHARED, "InferenceSection", defaults={"port": 0}
)
OrchestratorSection = section_of(OrchestratorConfig, ORCHESTRATOR_SHARED, "OrchestratorSection")
TrainerSection = section_of(TrainerConfig, TRAINER_SHARED, "TrainerSection")


class DevicesSection(Section):
    """Which GPUs each process gets (CUDA indices). Unset: no GPU -> everything on the CPU; one GPU -> inference and
    trainer share it (colocated); several -> inference on GPU 0, the trainer on the others (one rank each)."""

    inference: list[int] | None = Field(None, description="GPUs of the inference server ([] = CPU)")
    trainer: list[int] | None = Field(None, description="GPUs of the trainer, one rank per GPU ([] = CPU, one rank)")


@dataclass(frozen=True)
class DeviceAssignment:
    inference: list[int]
    trainer: list[int]

    @property
    def trainer_ranks(self) -> int:
        return max(1, len(self.trainer))

    @property
    def colocated(self) -> bool:
        return bool(set(self.inference) & set(self.trainer))


class RLConfig(ProcessConfig):
    """Run RL end to end: the inference server, the orchestrator and the trainer, with shared settings set once."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy: served, sampled and trained")
    output_dir: Path = Field(Path("runs/rl"), description="the run directory (logs, rollouts, weights, checkpoints)")
    seed: int = Field(0, description="seed of every process (task order, sampling seeds, initialisation)")
    max_steps: int = Field(20, ge=1, description="trainer steps (and batches) of the run")
    max_async_steps: int = Field(
        1, ge=0, description="rollouts for step n come from policy >= n - max_async_steps (0: synchronous)"
    )
    seq_len: int = Field(2048, ge=8, description="tokens per packed training row")
    resume: bool = Field(False, description="continue the run in output_dir from its newest checkpoints")
    devices: DevicesSection = Field(default_factory=DevicesSection, description="GPU assignment")
    inference: InferenceSection = Field(default_factory=InferenceSection, description="the inference server")
    orchestrator: OrchestratorSection = Field(default_factory=OrchestratorSection, description="the orchestrator")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="the trainer")
    shutdown_grace_s: float = Field(20.0, gt=0, description="on stop, wait this long before killing a process")

    @model_validator(mode="after")
    def _processes_valid(self) -> RLConfig:
        # Building each process config runs its own validators (e.g. the trainer's schedule check) now, not later.
        self.process_configs(DeviceAssignment([], []), base_url="http://127.0.0.1:0")
        return self

    def assign_devices(self, num_gpus: int) -> DeviceAssignment:
        """Resolve `devices` against the GPUs this host has."""
        auto_inference, auto_trainer = ([], []) if num_gpus == 0 else ([0], [0]) if num_gpus == 1 else (
            [0], list(range(1, num_gpus)))
        inference = auto_inference if self.devices.inference is None else self.devices.inference
        trainer = auto_trainer if self.devices.trainer is None else self.devices.trainer
        for role, ids in (("inference", inference), ("trainer", trainer)):
            bad = [i for i in ids if not 0 <= i < num_gpus]
            if bad:
                raise ValueError(f"devices.{role} names GPU(s) {bad}, but this host has {num_gpus}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"devices.{role} lists a GPU twice: {ids}")
        return DeviceAssignment(inference, trainer)

    def process_configs(
        self, devices: DeviceAssignment, base_url: str
    ) -> tuple[InferenceConfig, OrchestratorConfig, TrainerConfig]:
        """The three process configs, with the shared keys and launcher facts filled in. Every field is passed
        explicitly, so nothing from the environment leaks in."""
        model = self.model.model_dump()
        inference = self.inference.model_dump()
        inference.update(model=model, seed=self.seed)
        if devices.colocated and inference["engine"] == "vllm" and "gpu_memory_utilization" not in (
                self.inference.vllm.model_fields_set):
            inference["vllm"]["gpu_memory_utilization"] = 0.45  # leave the trainer half of the shared GPU
        orchestrator = self.orchestrator.model_dump()
        orchestrator.update(
            run_dir=self.output_dir, model=model, seed=self.seed, max_steps=self.max_steps,
            max_async_steps=self.max_async_steps, resume=self.resume,
            served_model_name=self.inference.served_model_name,
        )
        orchestrator["client"]["base_url"] = base_url
        orchestrator["batch"].update(seq_len=self.seq_len, num_ranks=devices.trainer_ranks)
        trainer = self.trainer.model_dump()
        trainer.update(run_dir=self.output_dir, model=model)
        trainer["train"].update(max_steps=self.max_steps, seed=self.seed)
        trainer["ckpt"]["resume"] = "latest" if self.resume else None
        token = FILE_LAYER.set({})  # the rl config's own files are being read now; they are not these processes'
        try:
            return InferenceConfig(**inference), OrchestratorConfig(**orchestrator), TrainerConfig(**trainer)
        except pydantic.ValidationError as e:
            raise ValueError(_one_line(e)) from None
        finally:
            FILE_LAYER.reset(token)


def _one_line(error: pydantic.ValidationError) -> str:
    return f"{error.title}: " + "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
    )
