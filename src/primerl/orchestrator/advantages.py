"""Advantages: one number per rollout, computed from the (shaped) rewards of the rollouts of the same task (a group),
or, for on-policy distillation, one per sampled token.

An estimator takes the group's rewards and returns one advantage per reward, in order:

    def my_advantage(rewards: Sequence[float], **kwargs) -> list[float]

`[orchestrator.advantage] type` picks a built-in below (dr_grpo, grpo, rloo, reinforce, distill) or `custom` with
`path = "module:function"`. `Scorer` applies it to a group: failed rollouts are left out of the baseline and get no
advantage; reward shaping (`shaping`) comes first; `distill` adds the teacher's per-token signal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from primerl.config.algorithms import (
    AdvantageConfig,
    CustomAdvantage,
    DistillAdvantage,
    DrGRPOAdvantage,
    GRPOAdvantage,
    ReinforceAdvantage,
    RLOOAdvantage,
)
from primerl.imports import import_object
from primerl.orchestrator.shaping import RewardShaping

Estimator = Callable[[Sequence[float]], list[float]]
SampleAdvantage = float | list[float]


def group_mean_baseline(rewards: Sequence[float]) -> list[float]:
    """Reward minus the group mean (Dr. GRPO): unbiased, keeps the reward's scale."""
    if not rewards:
        return []
    mean = math.fsum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def grpo(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """Reward minus the group mean, divided by the group's standard deviation (+ `eps`): GRPO's normalisation."""
    centred = group_mean_baseline(rewards)
    if not centred:
        return []
    std = math.sqrt(math.fsum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def rloo(rewards: Sequence[float]) -> list[float]:
    """Reward minus the mean of the group's other rewards (leave-one-out); 0 for a group of one (no baseline)."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = math.fsum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def reinforce(rewards: Sequence[float], baseline: float = 0.0) -> list[float]:
    """Plain REINFORCE: reward minus a constant baseline."""
    return [r - baseline for r in rewards]


def load_advantage_fn(path: str, kwargs: dict[str, Any] | None = None) -> Estimator:
    """The function `module:name` with `kwargs` bound. Raises ValueError naming the path when it cannot be loaded."""
    fn = import_object(path, "advantage function")
    if not callable(fn):
        raise TypeError(f"advantage function {path!r} is not callable")
    options = dict(kwargs or {})

    def advantage(rewards: Sequence[float]) -> list[float]:
        out = [float(a) for a in fn(list(rewards), **options)]
        if len(out) != len(rewards):
            raise ValueError(f"advantage function {path!r} returned {len(out)} values for {len(rewards)} rewards")
        return out

    return advantage


def estimator(cfg: AdvantageConfig) -> Estimator:
    """The per-group estimator `cfg` selects (for distill: that of its task-reward part)."""
    if isinstance(cfg, CustomAdvantage):
        return load_advantage_fn(cfg.path, cfg.kwargs)
    if isinstance(cfg, DistillAdvantage):
        return estimator({"dr_grpo": DrGRPOAdvantage(), "grpo": GRPOAdvantage(), "rloo": RLOOAdvantage(),
                          "reinforce": ReinforceAdvantage()}[cfg.reward_advantage])
    if isinstance(cfg, GRPOAdvantage):
        return lambda rewards: grpo(rewards, cfg.eps)
    if isinstance(cfg, ReinforceAdvantage):
        return lambda rewards: reinforce(rewards, cfg.baseline)
    return {"dr_grpo": group_mean_baseline, "rloo": rloo}[cfg.type]


def is_zero_advantage(advantages: Sequence[float], tol: float = 1e-9) -> bool:
    """True when no rollout of the group is better or worse than another: the group carries no learning signal."""
    return all(abs(a) <= tol for a in advantages)


def distill_token_advantages(sample: Any, teacher_logprobs: Sequence[float], kl_coef: float, reward_coef: float,
                             rollout_advantage: float) -> list[float]:
    """Per token of `sample`: on sampled tokens kl_coef (log p_teacher - log p_sampler) + reward_coef A (the negated
    per-token reverse KL to the teacher, plus the task advantage), 0 elsewhere."""
    if len(teacher_logprobs) != len(sample.input_ids):
        raise ValueError(f"teacher returned {len(teacher_logprobs)} log-probs for {len(sample.input_ids)} tokens")
    return [
        kl_coef * (teacher - sampler) + reward_coef * rollout_advantage if sampled else 0.0
        for sampled, teacher, sampler in zip(sample.loss_mask, teacher_logprobs, sample.inference_logprobs,
                                             strict=True)
    ]


@dataclass
class Scored:
    """A group's scores: `advantages` per rollout (trace) in the baseline, the `rewards` (shaped) they came from, and
    each sample's own advantage (None for a sample of a failed rollout; a list per token for distillation)."""

    advantages: dict[str, float]
    rewards: dict[str, float]
    sample_advantages: list[SampleAdvantage | None]


class Scorer:
    """Shaping, then the estimator, over a group's rollouts that did not fail; then each sample's advantage."""

    def __init__(self, cfg: AdvantageConfig, shaping: RewardShaping | None = None):
        self.estimator = estimator(cfg)
        self.shaping = shaping
        self.distill = cfg if isinstance(cfg, DistillAdvantage) else None

    def __call__(self, samples: Sequence[Any], teacher_logprobs: Mapping[int, Sequence[float]] | None = None) -> Scored:
        """`samples` of one group (a rollout may have several; they share its reward); `teacher_logprobs` by
        `id(sample)` for distillation. A failed rollout's reward says nothing about the policy, so it neither gets an
        advantage nor moves the others' baseline."""
        failed = {s.trace_id for s in samples if s.error is not None}
        rewards: dict[str, float] = {}
        sampled: dict[str, int] = {}
        for s in samples:
            if s.trace_id not in failed:
                rewards.setdefault(s.trace_id, float(s.reward))
                sampled[s.trace_id] = sampled.get(s.trace_id, 0) + sum(s.loss_mask)
        if self.shaping is not None:
            rewards = {trace: self.shaping(reward, sampled[trace]) for trace, reward in rewards.items()}
        advantages = dict(zip(rewards, self.estimator(list(rewards.values())))) if rewards else {}
        return Scored(advantages, rewards, [self._of_sample(s, advantages, teacher_logprobs or {}) for s in samples])

    def _of_sample(self, sample: Any, advantages: dict[str, float],
                   teacher_logprobs: Mapping[int, Sequence[float]]) -> SampleAdvantage | None:
        advantage = advantages.get(sample.trace_id)
        if advantage is None or self.distill is None:
            return advantage
        if id(sample) not in teacher_logprobs:  # not scored by the teacher: nothing it samples is trained
            return self.distill.reward_coef * advantage
        return distill_token_advantages(sample, teacher_logprobs[id(sample)], self.distill.kl_coef,
                                        self.distill.reward_coef, advantage)
