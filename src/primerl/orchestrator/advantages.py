"""Advantages: one number per rollout, computed from the rewards of the rollouts of the same task (a group).

An advantage function takes the group's rewards and keyword options and returns one advantage per reward, in order:

    def my_advantage(rewards: Sequence[float], **kwargs) -> list[float]

`OrchestratorConfig.advantage.path` names one by import path (`module:function`); the built-ins are below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from primerl.imports import import_object

AdvantageFn = Callable[..., list[float]]


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


def load_advantage_fn(path: str, kwargs: dict[str, Any] | None = None) -> Callable[[Sequence[float]], list[float]]:
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


def is_zero_advantage(advantages: Sequence[float], tol: float = 1e-9) -> bool:
    """True when no rollout of the group is better or worse than another: the group carries no learning signal."""
    return all(abs(a) <= tol for a in advantages)
