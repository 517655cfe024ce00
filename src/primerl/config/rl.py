"""Config of `rl`: one file for a whole run. Keys the three processes share are set once at the top level and copied
into each process's config; the `[inference]`, `[orchestrator]` and `[trainer]` tables hold everything else.

    model.name = "smollm2-135m-instruct"   # -> inference.model, orchestrator.model, trainer.model
    output_dir = "runs/reverse-text"        # -> orchestrator.run_dir, trainer.run_dir (the run directory)
    seed = 0                                # -> inference.seed, orchestrator.seed, trainer.train.seed
    max_steps = 20                          # -> orchestrator.max_steps, trainer.train.max_steps
    max_async_steps = 1                     # -> orchestrator.max_async_steps
    deterministic = false                   # CPU, synchronous, fixed threads: replays bit for bit (determinism.py)
    seq_len = 2048                          # -> orchestrator.batch.seq_len (the trainer reads it from each batch)
    wandb.project = "reverse-text"          # -> orchestrator.wandb, trainer.wandb (one W&B run for both)
    weight_transfer = "filesystem"          # -> trainer.weights.transfer, inference.weight_transfer

A shared key cannot be set again inside a section (it is not a key of the section at all), so a run never has two
models or two run directories. The launcher fills in what only it knows: the server's URL and admin token, the trainer's
data-parallel size (from `devices`), `--resume`, and with `weight_transfer = "broadcast"` the weight group's port
(a free one when `trainer.weights.broadcast.port` is 0) and receiver count, copied to the server as well.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
from pydantic import Field, create_model, model_validator

from primerl.config import determinism
from primerl.config.algorithms import move_legacy_filter_keys
from primerl.config.base import ProcessConfig, Section
from primerl.config.common import ModelConfig, WandbConfig
from primerl.config.inference import InferenceConfig
from primerl.config.loader import FILE_LAYER
from primerl.config.orchestrator import OrchestratorConfig
from primerl.config.trainer import TrainerConfig
from primerl.ports import free_port
from primerl.transport.weight_transfer.modes import WeightTransfer, transfer_mode

# Dotted keys of each process config that the rl config sets from its top level (or the launcher sets).
INFERENCE_SHARED = {"model", "seed", "admin_token", "admin_token_file", "weight_transfer", "weight_broadcast"}
ORCHESTRATOR_SHARED = {
    "run_dir", "model", "served_model_name", "seed", "max_steps", "max_async_steps", "resume", "admin_token",
    "client.base_url", "client.base_urls", "batch.seq_len", "batch.num_ranks", "wandb", "teacher",
}
TRAINER_SHARED = {
    "run_dir", "model", "train.max_steps", "train.seed", "train.deterministic", "ckpt.resume", "weights.transfer",
    "weights.broadcast.receivers", "wandb",
}
# The teacher server's keys that `rl` sets itself (its seed is the run's; no weights ever reach it; its admin token
# is its own).
TEACHER_EXCLUDED = {"seed", "admin_token", "admin_token_file", "weight_transfer", "weight_broadcast"}
# What `process_configs` puts in for `trainer.weights.broadcast.port = 0` when the caller names no port: validation
# only needs some port, and must not hold one.
_UNBOUND_PORT = 1
# A recipe is a run meant to reach its end unattended (often for hours): its rl stage restarts a failed run up to this
# many times. A plain config defaults to 0, since it is what one debugs with: a failure should stop at once, with the
# failed process's log on the console, not be retried behind the user's back.
RECIPE_MAX_RESTARTS = 3
RECIPE_DEFAULTS = {"max_restarts": RECIPE_MAX_RESTARTS}  # a recipe's rl stage starts from these (recipes.schema)
# The teacher's URL while it is not known (config validation, the checklist): nothing connects to it.
_UNBOUND_TEACHER_URL = "http://127.0.0.1:0"


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
TeacherSection = section_of(InferenceConfig, TEACHER_EXCLUDED, "TeacherSection", defaults={"port": 0})
TeacherSection.__doc__ = ("The teacher of on-policy distillation (orchestrator.advantage.type = 'distill'): `rl` serves "
                          "this model from a second inference server, on the inference server's devices.")
TrainerSection = section_of(TrainerConfig, TRAINER_SHARED, "TrainerSection")


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_thread_split(cores: int) -> tuple[int, int]:
    """Threads for the engine and the trainer when both run on the CPU at once (the async loop overlaps generating
    step n + 1 with training step n): half the cores each, the trainer the odd one; one each on one or two cores."""
    engine = max(1, cores // 2)
    return engine, max(1, cores - engine)


class DevicesSection(Section):
    """Which GPUs each process gets: indices into the host's GPUs (into CUDA_VISIBLE_DEVICES when that is set).

    Unset: no GPU -> everything on the CPU; one GPU -> inference and trainer share it (colocated); several -> the
    inference server on the first (the first `inference.vllm.tensor_parallel_size` with vLLM), the trainer on all
    the others, one rank each. Setting one list gives the other the GPUs that are left. Several inference GPUs are
    for vLLM (tensor parallel over them); the embedded hf engine serves from one. The two lists may only overlap as
    one shared GPU."""

    inference: list[int] | None = Field(
        None, description="GPUs of the inference server ([] = CPU; several = vLLM tensor parallel)"
    )
    trainer: list[int] | None = Field(None, description="GPUs of the trainer, one rank per GPU ([] = CPU, one rank)")


@dataclass(frozen=True)
class DeviceAssignment:
    """The GPUs (indices into the host's GPUs) of the inference server and of the trainer; [] = the CPU."""

    inference: list[int]
    trainer: list[int]

    @property
    def trainer_ranks(self) -> int:
        return max(1, len(self.trainer))

    @property
    def colocated(self) -> bool:
        """Inference and trainer share one GPU (the only overlap `assign_devices` allows)."""
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
    deterministic: bool = Field(
        False, description="replay bit for bit: CPU only, max_async_steps = 0, the embedded engine one sequence at a "
        "time, one thread per process, float32, deterministic algorithms, a weight checksum per step "
        "(primerl.config.determinism)"
    )
    resume: bool = Field(False, description="continue the run in output_dir from its newest checkpoints")
    weight_transfer: WeightTransfer = Field(
        "filesystem",
        description="how new weights reach inference: filesystem = full snapshots under weights/; broadcast = a "
        "collective group from trainer rank 0 to the server (trainer.weights.broadcast sets it up); shared = the "
        "server copies each version from the trainer's buffer on the device they share (one GPU, or the CPU)",
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="Weights & Biases: one W&B run for the trainer and the orchestrator"
    )
    devices: DevicesSection = Field(default_factory=DevicesSection, description="GPU assignment")
    inference: InferenceSection = Field(default_factory=InferenceSection, description="the inference server")
    orchestrator: OrchestratorSection = Field(default_factory=OrchestratorSection, description="the orchestrator")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="the trainer")
    teacher: TeacherSection | None = Field(
        None, description="the teacher server of orchestrator.advantage.type = 'distill' (its model.name is required)"
    )
    shutdown_grace_s: float = Field(20.0, gt=0, description="on stop, wait this long before killing a process")
    max_restarts: int = Field(
        0, ge=0, description="when a process dies or the run hangs, stop the rest and resume the whole run from its "
        "last checkpoint, at most this many times (a crash loop stops sooner); 0 = stop with the error. A recipe's rl "
        f"stage defaults to {RECIPE_MAX_RESTARTS}"
    )
    stall_timeout_s: float = Field(
        600.0, ge=0, description="a run with no new metrics record for this long has hung: it is stopped (and "
        "restarted when max_restarts allows); 0 = never"
    )
    preload: bool = Field(
        True, description="on a CPU-only run (embedded engine, one trainer rank, Linux), the launcher imports torch and "
        "transformers once and starts the server and the trainer as forks of itself, instead of each importing them "
        "again (about 9 CPU-s each, on the cores the start-up shares); false: each starts a new interpreter"
    )
    keep_weights_after_run: int = Field(
        1, ge=0, description="weight snapshots a finished run keeps, newest first: 1 = the trained model only (a "
        "resume needs only the checkpoints); 0 = leave weights/ as trainer.weights.keep_last left it"
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_filter_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "orchestrator" in data:
            data = {**data, "orchestrator": move_legacy_filter_keys(data["orchestrator"])}
        return data

    @model_validator(mode="before")
    @classmethod
    def _deterministic_is_synchronous(cls, data: Any) -> Any:
        if isinstance(data, dict) and str(data.get("deterministic", "")).lower() in ("true", "1", "yes"):
            data = {**data, "max_async_steps": 0}  # whatever a recipe or file says (docs/recipes.md)
        return data

    @model_validator(mode="after")
    def _deterministic_settings(self) -> RLConfig:
        if self.deterministic:
            determinism.check(self.inference.engine)
            if self.teacher is not None:
                raise ValueError("deterministic = true does not cover a [teacher] server; drop one of them")
        return self

    @model_validator(mode="after")
    def _teacher_for_distillation(self) -> RLConfig:
        distill = self.orchestrator.advantage.type == "distill"
        if distill and self.teacher is None:
            raise ValueError("orchestrator.advantage.type = 'distill' needs a [teacher] (teacher.model.name = the "
                             "model to distil from)")
        if self.teacher is not None and not distill:
            raise ValueError("a [teacher] is set but orchestrator.advantage.type is not 'distill': nothing would use "
                             "it")
        if self.teacher is not None and "model" not in self.teacher.model_fields_set:
            raise ValueError("teacher.model.name is required: the model to distil from")
        return self

    @model_validator(mode="after")
    def _processes_valid(self) -> RLConfig:
        # Building each process config runs its own validators (e.g. the trainer's schedule check) now, not later.
        self.process_configs(DeviceAssignment([], []), base_url="http://127.0.0.1:0", broadcast_port=_UNBOUND_PORT)
        return self

    @model_validator(mode="after")
    def _transfer_feeds_the_server(self) -> RLConfig:
        if self.inference.engine == "vllm":
            transfer_mode(self.weight_transfer).check_sharded_server(self.inference.vllm.tensor_parallel_size)
        return self

    @model_validator(mode="after")
    def _devices_valid(self) -> RLConfig:
        # What can be checked without knowing the host's GPUs fails when the config is resolved, not at launch.
        self._check_devices(self.devices.inference, self.devices.trainer)
        return self

    def assign_devices(self, num_gpus: int) -> DeviceAssignment:
        """Resolve `devices` against the `num_gpus` GPUs this host has (rules: `DevicesSection`). ValueError, naming
        the fix, for a layout that cannot work."""
        inference, trainer = self.devices.inference, self.devices.trainer
        if num_gpus == 0:
            inference, trainer = inference or [], trainer or []
        if inference is None:
            inference = self._auto_inference(num_gpus, trainer)
        if trainer is None:
            left = [g for g in range(num_gpus) if g not in inference]
            if not left and len(inference) > 1:
                raise ValueError(f"the inference server takes every GPU ({inference}), leaving none for the trainer: "
                                 "set devices.trainer ([] trains on the CPU) or give devices.inference fewer GPUs")
            trainer = left or list(inference)  # one GPU only: the trainer shares it (colocated)
        self._check_devices(inference, trainer, num_gpus)
        if self.deterministic:
            determinism.check_devices(inference, trainer)
        transfer_mode(self.weight_transfer).check_devices(inference, trainer)
        return DeviceAssignment(list(inference), list(trainer))

    def with_devices(self, devices: DeviceAssignment) -> RLConfig:
        """This config with what the device assignment decides filled in before the process configs are built:
        vLLM's `tensor_parallel_size` becomes the number of inference GPUs (an explicit one was checked equal)."""
        if self.inference.engine != "vllm" or not devices.inference:
            return self
        vllm = self.inference.vllm.model_copy(update={"tensor_parallel_size": len(devices.inference)})
        return self.model_copy(update={"inference": self.inference.model_copy(update={"vllm": vllm})})

    def _auto_inference(self, num_gpus: int, trainer: list[int] | None) -> list[int]:
        """The first GPUs the trainer does not use, as many as the engine takes; the trainer's one GPU if none."""
        vllm = self.inference.vllm
        wanted = vllm.tensor_parallel_size if self.inference.engine == "vllm" else 1
        left = [g for g in range(num_gpus) if g not in (trainer or [])]
        if len(left) >= wanted:
            return left[:wanted]
        if wanted == 1 and trainer is not None and len(trainer) == 1:
            return list(trainer)
        if wanted > 1:
            have = f"this host has {num_gpus}" if trainer is None else (
                f"{len(left)} of this host's {num_gpus} are not the trainer's")
            raise ValueError(f"inference.vllm.tensor_parallel_size = {wanted} needs {wanted} GPUs for the server, but "
                             f"{have}: lower tensor_parallel_size or give the trainer fewer GPUs")
        raise ValueError(f"devices.trainer takes every GPU ({trainer}), leaving none for the inference server: set "
                         "devices.inference ([] serves from the CPU) or give devices.trainer fewer GPUs")

    def _check_devices(self, inference: list[int] | None, trainer: list[int] | None,
                       num_gpus: int | None = None) -> None:
        """ValueError for a device layout that cannot work; None = not known yet (skips the checks that need it)."""
        for role, ids in (("inference", inference), ("trainer", trainer)):
            if ids is None:
                continue
            if len(set(ids)) != len(ids):
                raise ValueError(f"devices.{role} lists a GPU twice: {ids}")
            bad = [i for i in ids if i < 0 or (num_gpus is not None and i >= num_gpus)]
            if bad:
                have = "" if num_gpus is None else ", but this host has no GPU" if num_gpus == 0 else (
                    f", but this host has {num_gpus} (indices 0 to {num_gpus - 1})")
                raise ValueError(f"devices.{role} names GPU(s) {bad}{have}")
        if inference is not None:
            self._check_engine_devices(inference, explicit=self.devices.inference is not None)
        if inference is not None and trainer is not None:
            shared = sorted(set(inference) & set(trainer))
            if shared and not (len(inference) == len(trainer) == 1):
                raise ValueError(
                    f"devices.inference {inference} and devices.trainer {trainer} share GPU(s) {shared}: inference "
                    "and trainer can share a GPU only when each uses that one GPU alone (colocated: inference = [0], "
                    "trainer = [0]); give them separate GPUs"
                )

    def _check_engine_devices(self, inference: list[int], explicit: bool) -> None:
        engine, vllm = self.inference.engine, self.inference.vllm
        if engine == "hf" and len(inference) > 1:
            raise ValueError(
                f"the embedded hf engine serves from one GPU, but devices.inference lists {len(inference)} "
                f"({inference}): list one GPU, or set inference.engine = 'vllm' to shard the model over them "
                "(tensor parallel)"
            )
        if engine != "vllm":
            return
        if not inference:
            where = "devices.inference = [] puts the server on the CPU" if explicit else "this host has no GPU"
            raise ValueError(f"inference.engine = 'vllm' needs a GPU, but {where}: use inference.engine = 'hf' for "
                             "the CPU")
        if "tensor_parallel_size" in vllm.model_fields_set and vllm.tensor_parallel_size != len(inference):
            raise ValueError(
                f"inference.vllm.tensor_parallel_size = {vllm.tensor_parallel_size}, but devices.inference lists "
                f"{len(inference)} GPU(s) ({inference}): they must match (unset, tensor_parallel_size follows the "
                "number of inference GPUs)"
            )

    def process_configs(
        self, devices: DeviceAssignment, base_url: str, broadcast_port: int | None = None,
        teacher_url: str | None = None,
    ) -> tuple[InferenceConfig, OrchestratorConfig, TrainerConfig]:
        """The three process configs, with the shared keys and launcher facts filled in. Every field is passed
        explicitly, so nothing from the environment leaks in. `broadcast_port` is the weight group's port when
        `trainer.weights.broadcast.port` is 0 (None: a free port of this host, picked now); `teacher_url` is the
        teacher server's root URL when there is a [teacher] (None: not known yet, a placeholder)."""
        model = self.model.model_dump()
        inference = self.inference.model_dump()
        inference.update(model=model, seed=self.seed)
        if devices.colocated and inference["engine"] == "vllm" and "gpu_memory_utilization" not in (
                self.inference.vllm.model_fields_set):
            inference["vllm"]["gpu_memory_utilization"] = 0.45  # leave the trainer half of the shared GPU
        orchestrator = self.orchestrator.model_dump()
        wandb = self.wandb.model_dump()
        orchestrator.update(
            run_dir=self.output_dir, model=model, wandb=wandb, seed=self.seed, max_steps=self.max_steps,
            max_async_steps=self.max_async_steps, resume=self.resume,
            served_model_name=self.inference.served_model_name,
        )
        orchestrator["client"]["base_url"] = base_url
        if self.teacher is not None:
            orchestrator["teacher"] = {"base_url": teacher_url or _UNBOUND_TEACHER_URL,
                                       "model": self.teacher.served_model_name or self.teacher.model.name}
        orchestrator["batch"].update(seq_len=self.seq_len, num_ranks=devices.trainer_ranks)
        if orchestrator["batch"]["share_prompts"] is None:
            attention = self.trainer.train.attention
            orchestrator["batch"]["share_prompts"] = attention in ("sdpa", "flex_attention", "eager") or (
                attention == "auto" and not devices.trainer)
        trainer = self.trainer.model_dump()
        trainer.update(run_dir=self.output_dir, model=model, wandb=wandb)
        trainer["train"].update(max_steps=self.max_steps, seed=self.seed)
        trainer["ckpt"]["resume"] = "latest" if self.resume else None
        if not devices.inference and not devices.trainer:  # both on the CPU: split its cores, no oversubscription
            engine_threads, trainer_threads = cpu_thread_split(usable_cpus())
            if inference["threads"] is None and inference["engine"] == "hf":
                inference["threads"] = engine_threads
            if trainer["train"]["threads"] is None:
                trainer["train"]["threads"] = trainer_threads
        if trainer["train"]["warm_up_tokens"] is None:  # the trainer waits for its first batch: warm up meanwhile,
            # except beside vLLM on its GPU, whose start measures the memory left free while the warm-up takes some
            beside_vllm = devices.colocated and inference["engine"] == "vllm"
            trainer["train"]["warm_up_tokens"] = 0 if beside_vllm else self.seq_len
        if self.deterministic:
            determinism.apply(inference, orchestrator, trainer)
        self._share_weight_transfer(inference, trainer, broadcast_port)
        token = FILE_LAYER.set({})  # the rl config's own files are being read now; they are not these processes'
        try:
            return InferenceConfig(**inference), OrchestratorConfig(**orchestrator), TrainerConfig(**trainer)
        except pydantic.ValidationError as e:
            raise ValueError(_one_line(e)) from None
        finally:
            FILE_LAYER.reset(token)


    def teacher_config(self, devices: DeviceAssignment) -> InferenceConfig | None:
        """The teacher server's config (None without a [teacher]): the run's seed; on a CPU-only run as many engine
        threads as the policy server's unless `teacher.threads` is set."""
        if self.teacher is None:
            return None
        teacher = self.teacher.model_dump()
        teacher["seed"] = self.seed
        if not devices.inference and not devices.trainer and teacher["threads"] is None and teacher["engine"] == "hf":
            teacher["threads"] = cpu_thread_split(usable_cpus())[0]
        token = FILE_LAYER.set({})
        try:
            return InferenceConfig(**teacher)
        except pydantic.ValidationError as e:
            raise ValueError("teacher: " + _one_line(e)) from None
        finally:
            FILE_LAYER.reset(token)

    def _share_weight_transfer(self, inference: dict[str, Any], trainer: dict[str, Any],
                               broadcast_port: int | None) -> None:
        """`weight_transfer` into both processes; with broadcast, one port for the group and the server's receiver
        count (one per vLLM tensor-parallel worker, one for the embedded engine) for the trainer."""
        inference["weight_transfer"] = trainer["weights"]["transfer"] = self.weight_transfer
        group = trainer["weights"]["broadcast"]
        if not transfer_mode(self.weight_transfer).weight_group:
            group["receivers"] = 1
            return
        group["port"] = group["port"] or broadcast_port or free_port(group["host"])
        group["receivers"] = inference["vllm"]["tensor_parallel_size"] if inference["engine"] == "vllm" else 1
        inference["weight_broadcast"] = {key: group[key] for key in ("host", "port", "init_timeout_s", "timeout_s")}


def _one_line(error: pydantic.ValidationError) -> str:
    return f"{error.title}: " + "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
    )
