"""The orchestrator's algorithm choices, each selected by `type` with its own options (docs/algorithms.md):

    [orchestrator.advantage]   type = "dr_grpo" | "grpo" | "rloo" | "reinforce" | "distill" | "custom"
    [[orchestrator.shaping]]   type = "overlong" | "length_penalty"       (reward shaping, applied in order)
    [[orchestrator.filters]]   type = "zero_advantage" | "equal_rewards"  (groups dropped and replaced)
    [orchestrator.sampler]     type = "uniform" | "difficulty"
    [orchestrator.teacher]     the teacher server of `advantage.type = "distill"` (rl fills it in)

The trainer's choices (`[trainer.loss]`, `[trainer.reference]`) are in `primerl.config.trainer`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from primerl.config.base import Section

# ---------------------------------------------------------------------------------------------------------------------
# Advantages


class DrGRPOAdvantage(Section):
    """Reward minus the group mean (Dr. GRPO): unbiased, keeps the reward's scale (the default)."""

    type: Literal["dr_grpo"] = "dr_grpo"


class GRPOAdvantage(Section):
    """Reward minus the group mean, divided by the group's standard deviation (GRPO)."""

    type: Literal["grpo"] = "grpo"
    eps: float = Field(1e-6, gt=0, description="added to the standard deviation")


class RLOOAdvantage(Section):
    """Reward minus the mean of the other rollouts of the group (REINFORCE leave-one-out)."""

    type: Literal["rloo"] = "rloo"


class ReinforceAdvantage(Section):
    """Plain REINFORCE: reward minus a constant baseline, no group statistic."""

    type: Literal["reinforce"] = "reinforce"
    baseline: float = Field(0.0, description="subtracted from every reward")


GroupEstimator = Literal["dr_grpo", "grpo", "rloo", "reinforce"]


class DistillAdvantage(Section):
    """On-policy distillation: each sampled token's advantage is kl_coef (log p_teacher - log p_sampler), the negated
    per-token reverse KL to the teacher, plus reward_coef times the rollout's task advantage."""

    type: Literal["distill"] = "distill"
    kl_coef: float = Field(1.0, ge=0, description="weight of the per-token reverse KL to the teacher")
    reward_coef: float = Field(0.0, ge=0, description="weight of the task reward's advantage (0: distillation only)")
    reward_advantage: GroupEstimator = Field(
        "dr_grpo", description="estimator of the task reward's advantage (with its default options)"
    )

    @model_validator(mode="after")
    def _some_signal(self) -> DistillAdvantage:
        if self.kl_coef == 0 and self.reward_coef == 0:
            raise ValueError("distill needs kl_coef > 0 or reward_coef > 0")
        return self


class CustomAdvantage(Section):
    """Your own function `module:function(rewards: list[float], **kwargs) -> list[float]`, one advantage per reward."""

    type: Literal["custom"] = "custom"
    path: str = Field(
        "primerl.orchestrator.advantages:group_mean_baseline", description="import path module:function"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the function")


LEGACY_FILTER_KEYS = ("drop_zero_advantage", "max_extra_groups")


def _untyped_advantage(value: Any) -> Any:
    """A table without `type`: a custom function when it names `path` or `kwargs` (configs written before advantages
    had a type; the path defaults to the group-mean baseline, as it always did), else the default estimator."""
    if isinstance(value, dict) and "type" not in value:
        return {"type": "custom" if "path" in value or "kwargs" in value else "dr_grpo", **value}
    return value


AdvantageConfig = Annotated[
    DrGRPOAdvantage | GRPOAdvantage | RLOOAdvantage | ReinforceAdvantage | DistillAdvantage | CustomAdvantage,
    Field(discriminator="type"),
    BeforeValidator(_untyped_advantage),
]


# ---------------------------------------------------------------------------------------------------------------------
# Reward shaping


class OverlongShaping(Section):
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer_tokens sampled tokens, then falling linearly to
    -penalty at max_tokens, and -penalty beyond."""

    type: Literal["overlong"] = "overlong"
    max_tokens: int | None = Field(None, ge=1, description="the length limit (None: orchestrator.sampling.max_tokens)")
    buffer_tokens: int | None = Field(
        None, ge=1, description="length of the linear zone before the limit (None: a quarter of max_tokens)"
    )
    penalty: float = Field(1.0, ge=0, description="the punishment at and beyond the limit")


class LengthPenalty(Section):
    """A penalty proportional to length: reward - coef * sampled tokens / max_tokens."""

    type: Literal["length_penalty"] = "length_penalty"
    coef: float = Field(0.1, ge=0, description="the penalty of a rollout of max_tokens sampled tokens")
    max_tokens: int | None = Field(None, ge=1, description="the length scale (None: orchestrator.sampling.max_tokens)")


ShapingConfig = Annotated[OverlongShaping | LengthPenalty, Field(discriminator="type")]


# ---------------------------------------------------------------------------------------------------------------------
# Group filters


class ZeroAdvantageFilter(Section):
    """Drop groups whose advantages are all zero: no learning signal (with a group baseline, all rewards equal)."""

    type: Literal["zero_advantage"] = "zero_advantage"


class EqualRewardsFilter(Section):
    """Drop groups whose (shaped) rewards are all equal, whatever the advantage estimator (DAPO's dynamic sampling)."""

    type: Literal["equal_rewards"] = "equal_rewards"
    tolerance: float = Field(0.0, ge=0, description="rewards closer than this count as equal")


FilterConfig = Annotated[ZeroAdvantageFilter | EqualRewardsFilter, Field(discriminator="type")]


def move_legacy_filter_keys(orchestrator: Any) -> Any:
    """Configs written before filters were a list set them in `[orchestrator.advantage]`: `drop_zero_advantage =
    false` is `filters = []` and `max_extra_groups` is `batch.max_extra_groups`. Moved here (a raw orchestrator table
    in, the same table with the keys moved out); setting a key both ways is an error."""
    if not isinstance(orchestrator, dict) or not isinstance(orchestrator.get("advantage"), dict):
        return orchestrator
    advantage = dict(orchestrator["advantage"])
    legacy = {key: advantage.pop(key) for key in LEGACY_FILTER_KEYS if key in advantage}
    if not legacy:
        return orchestrator
    out = {**orchestrator, "advantage": advantage}
    if "drop_zero_advantage" in legacy:
        if "filters" in orchestrator:
            raise ValueError("advantage.drop_zero_advantage and filters are both set; keep filters")
        out["filters"] = [{"type": "zero_advantage"}] if _true(legacy["drop_zero_advantage"]) else []
    if "max_extra_groups" in legacy:
        batch = dict(orchestrator.get("batch") or {})
        if "max_extra_groups" in batch:
            raise ValueError("advantage.max_extra_groups and batch.max_extra_groups are both set; keep the second")
        out["batch"] = {**batch, "max_extra_groups": legacy["max_extra_groups"]}
    return out


def _true(value: Any) -> bool:
    """A boolean as a config layer gives it (TOML: a bool; command line and environment: a string)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


# ---------------------------------------------------------------------------------------------------------------------
# Task samplers


class UniformSampler(Section):
    """Every task equally often: a fresh seeded shuffle of the environment's tasks each pass (the default)."""

    type: Literal["uniform"] = "uniform"


class DifficultySampler(Section):
    """Tasks whose last group was solved by every rollout (easy) or by none (hard) are drawn less often; each draw
    picks a task with probability proportional to its weight (1 for tasks not seen yet or in between). Needs a
    finite taskset."""

    type: Literal["difficulty"] = "difficulty"
    solved_at: float = Field(1.0, description="a rollout solved its task when its reward is at least this")
    easy_weight: float = Field(0.1, ge=0, description="weight of a task every rollout of its last group solved")
    hard_weight: float = Field(0.1, ge=0, description="weight of a task no rollout of its last group solved")


SamplerConfig = Annotated[UniformSampler | DifficultySampler, Field(discriminator="type")]


# ---------------------------------------------------------------------------------------------------------------------
# The teacher of on-policy distillation


class TeacherSection(Section):
    """The inference server whose model is the teacher of `advantage.type = "distill"`: the student's sampled tokens
    are scored by it through `/inference/v1/generate` (prompt log-probs). `rl` starts it and fills these in."""

    base_url: str | None = Field(None, description="teacher server root URL (no /v1 suffix)")
    model: str | None = Field(None, description="the name the teacher server serves its model as")
    max_concurrent_requests: int = Field(16, ge=1, description="scoring requests in flight at most")
