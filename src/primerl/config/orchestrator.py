"""Config of `primerl orchestrator`: which environment, how many rollouts per step, the algorithm choices (advantage,
shaping, filters, task sampler, teacher: `primerl.config.algorithms`), the async bound."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from primerl.config.algorithms import (
    AdvantageConfig,
    DrGRPOAdvantage,
    FilterConfig,
    SamplerConfig,
    ShapingConfig,
    TeacherSection,
    UniformSampler,
    ZeroAdvantageFilter,
    move_legacy_filter_keys,
)
from primerl.config.base import ProcessConfig, Section
from primerl.config.common import ModelConfig, WandbConfig


class RuntimeSection(Section):
    """Where each rollout's harness program and tools run (verifiers runtimes)."""

    type: Literal["subprocess", "docker"] = Field(
        "subprocess",
        description="subprocess = this host, no sandbox (in-process harnesses start nothing in it); docker = one "
        "container per rollout on the local Docker daemon",
    )
    image: str = Field("python:3.11-slim", description="docker: the image each rollout's container runs (needs python3)")
    cpu: float | None = Field(None, gt=0, description="docker: CPU cores per container (None: no limit)")
    memory: float | None = Field(None, gt=0, description="docker: memory per container in GB (None: no limit)")

    def verifiers_config(self) -> dict[str, Any]:
        """The verifiers `RuntimeConfig` fields of this runtime."""
        if self.type == "subprocess":
            return {"type": "subprocess"}
        return {"type": "docker", "image": self.image, "cpu": self.cpu, "memory": self.memory}


class EnvSection(Section):
    """The verifiers environment the rollouts run in, by id (an installed environment package)."""

    id: str = Field("reverse-text", description="environment id, e.g. reverse-text, alphabet-sort, wordle, math")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the environment's loader")
    harness: str | None = Field(
        None,
        description="harness id for every agent role: primerl-chat (the in-process chat loop), a verifiers harness "
        "(null, bash, ...) or an installed harness package (None: the taskset's own harness, else primerl-chat)",
    )
    runtime: RuntimeSection = Field(default_factory=RuntimeSection, description="where harness programs and tools run")
    allow_unsandboxed_tools: bool = Field(
        False,
        description="let a harness that gives the model a shell or file tools run on this host with runtime.type "
        "subprocess (no sandbox); without it such a harness needs runtime.type docker",
    )


class ClientSection(Section):
    """How the orchestrator reaches its inference server(s)."""

    base_url: str = Field("http://127.0.0.1:8000", description="inference server root URL (no /v1 suffix)")
    base_urls: list[str] | None = Field(
        None,
        description="several inference servers (root URLs): groups go to the least-loaded one and every weight "
        "version is loaded into all of them (overrides base_url)",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="give up on one model call after this long")
    startup_timeout_s: float = Field(900.0, gt=0, description="wait this long for the server's /health at start")
    retry_s: float = Field(
        120.0, gt=0, description="retry health checks and weight loads this long through dropped connections"
    )

    @field_validator("base_urls")
    @classmethod
    def _some_urls(cls, urls: list[str] | None) -> list[str] | None:
        if urls is not None and not urls:
            raise ValueError("base_urls must name at least one server (or leave it unset to use base_url)")
        if urls is not None and len(set(urls)) != len(urls):
            raise ValueError("base_urls lists a server twice")
        return urls

    @property
    def urls(self) -> list[str]:
        return list(self.base_urls) if self.base_urls else [self.base_url]


class SamplingSection(Section):
    """Sampling parameters of every rollout."""

    temperature: float = Field(1.0, gt=0, description="sampling temperature (the trainer divides its logits by it)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (< 1 biases the importance ratio)")
    top_k: int | None = Field(
        None, ge=1, description="sample among the k likeliest tokens (None: all; set, it biases the importance ratio)"
    )
    max_tokens: int = Field(256, ge=1, description="new tokens per model call at most")

    def biased_ratio_warning(self) -> str | None:
        """Why the trainer's importance ratio is biased under these settings, or None. The engine reports the
        log-probs of the truncated, renormalised distribution it sampled from, while the trainer computes them over
        the whole vocabulary: p/q is then off by the kept mass on every token."""
        cut = []
        if self.top_p < 1:
            cut.append(f"top_p = {self.top_p}")
        if self.top_k is not None:
            cut.append(f"top_k = {self.top_k}")
        if not cut:
            return None
        return (
            f"sampling with {' and '.join(cut)}: the engine's log-probs come from the truncated, renormalised "
            "distribution and the trainer's from the full one, so the importance ratio (and mismatch_kl) is biased; "
            "use top_p = 1 and no top_k for unbiased RL"
        )

    def verifiers_fields(self) -> dict[str, Any]:
        """The verifiers `SamplingConfig` fields (top_k passes through to the engine as a vLLM-style extension)."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}
        return fields | ({"top_k": self.top_k} if self.top_k is not None else {})


class BatchSection(Section):
    """What one trainer step gets: `tasks_per_step` groups of `group_size` rollouts, packed into rows."""

    tasks_per_step: int = Field(8, ge=1, description="tasks (prompts) per step; each gives one group of rollouts")
    group_size: int = Field(8, ge=1, description="rollouts per task; advantages compare rollouts of one group")
    seq_len: int = Field(
        2048, ge=8, description="tokens per packed row (a longer sample is left out of the batch, counted)"
    )
    num_ranks: int = Field(1, ge=1, description="trainer data-parallel ranks the rows are split over")
    share_prompts: bool | None = Field(
        None,
        description="lay a group's common prompt out once per row, followed by each rollout's own tokens, so the "
        "trainer computes it once (needs trainer attention sdpa, flex_attention or eager); None: `rl` turns it on "
        "when the trainer runs on the CPU, off otherwise",
    )
    max_concurrent_groups: int | None = Field(
        None, ge=1, description="groups in flight at most (None: as many as the async bound allows)"
    )
    max_extra_groups: int | None = Field(
        None,
        ge=0,
        description="extra groups one step may sample to replace groups the filters dropped, before it keeps such "
        "groups (None: tasks_per_step)",
    )


class OrchestratorCheckpointSection(Section):
    """The orchestrator's own progress (next step, task cursor, counters) under checkpoints/step_<n>/orchestrator/."""

    interval: int = Field(1, ge=1, description="save after every this many batches")
    keep_last: int = Field(2, ge=1, description="keep the newest this many orchestrator checkpoints")


class OrchestratorConfig(ProcessConfig):
    """The orchestrator: runs the environment against the inference server, scores rollouts, computes advantages,
    writes `rollouts/step_<n>/`, and loads each new `weights/step_<k>/` into the server."""

    run_dir: Path = Field(Path("runs/debug"), description="the run directory shared with the other processes")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy being trained (served by inference)")
    served_model_name: str | None = Field(None, description="name the server serves the model as (default: model.name)")
    env: EnvSection = Field(default_factory=EnvSection, description="environment")
    client: ClientSection = Field(default_factory=ClientSection, description="inference server")
    admin_token: SecretStr | None = Field(
        None, description="bearer token of the server's /admin routes; read from PRIMERL_ADMIN_TOKEN"
    )
    sampling: SamplingSection = Field(default_factory=SamplingSection, description="sampling")
    batch: BatchSection = Field(default_factory=BatchSection, description="batch size and packing")
    advantage: AdvantageConfig = Field(
        default_factory=DrGRPOAdvantage,
        description="advantage estimator, by `type`: dr_grpo, grpo, rloo, reinforce, distill, custom "
        "(docs/algorithms.md)",
    )
    shaping: list[ShapingConfig] = Field(
        default_factory=list, description="reward shaping applied in order before the advantage: overlong, "
        "length_penalty"
    )
    filters: list[FilterConfig] = Field(
        default_factory=lambda: [ZeroAdvantageFilter()],
        description="groups dropped and replaced by new tasks (up to batch.max_extra_groups per step): "
        "zero_advantage, equal_rewards",
    )
    sampler: SamplerConfig = Field(
        default_factory=UniformSampler, description="which tasks are drawn, by `type`: uniform, difficulty"
    )
    teacher: TeacherSection = Field(
        default_factory=TeacherSection, description="the teacher server of advantage.type = 'distill'"
    )
    max_steps: int | None = Field(None, ge=1, description="write this many batches, then exit (None: run on)")
    max_async_steps: int = Field(
        1,
        ge=0,
        description="step n's rollouts start only once inference holds policy >= n - max_async_steps (0: synchronous)",
    )
    max_off_policy_steps: int | None = Field(
        None,
        ge=0,
        description="drop (and count) samples whose oldest policy version is older than step - this "
        "(None: max_async_steps)",
    )
    seed: int = Field(0, description="seed of the task order and of every rollout's sampling seed")
    workers: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="processes that run the rollouts (the environment, its interception server, rendering, scoring) "
        "beside the loop, which keeps the task order, the async bound and the batches; 0: in the loop's own "
        "process; auto: 0 on a machine of fewer than 8 cores, else half its cores, at most 8",
    )
    weights_poll_s: float = Field(0.05, gt=0, description="how often to look for new weights/step_<k>/")
    ckpt: OrchestratorCheckpointSection = Field(
        default_factory=OrchestratorCheckpointSection, description="orchestrator checkpoints"
    )
    resume: bool = Field(False, description="continue from the newest orchestrator checkpoint in run_dir")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging (off by default)")

    @model_validator(mode="before")
    @classmethod
    def _legacy_filter_keys(cls, data: Any) -> Any:
        return move_legacy_filter_keys(data)

    @model_validator(mode="after")
    def _distill_needs_a_teacher(self) -> OrchestratorConfig:
        if self.advantage.type == "distill" and not (self.teacher.base_url and self.teacher.model):
            raise ValueError("advantage.type = 'distill' needs teacher.base_url and teacher.model (rl sets them when "
                             "the config names a [teacher])")
        return self

    @model_validator(mode="after")
    def _bounds(self) -> OrchestratorConfig:
        if self.max_off_policy_steps is not None and self.max_off_policy_steps < self.max_async_steps:
            raise ValueError(
                f"max_off_policy_steps ({self.max_off_policy_steps}) < max_async_steps ({self.max_async_steps}) "
                "would drop rollouts the async bound allows"
            )
        return self

    @property
    def off_policy_limit(self) -> int:
        """Oldest policy lag a sample may have when it goes into a batch."""
        return self.max_async_steps if self.max_off_policy_steps is None else self.max_off_policy_steps
