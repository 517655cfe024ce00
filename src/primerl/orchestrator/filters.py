"""Group filters (`[[orchestrator.filters]]`): a finished group that a filter drops is not trained on, and a new task
is drawn in its place, up to `batch.max_extra_groups` per step (after that such groups are kept, so a run never
stalls). Each drop is counted per step under `groups_dropped_<filter type>`.

- `zero_advantage`: every advantage of the group is zero (per token too, for distillation): no learning signal.
- `equal_rewards`: the group's (shaped) rewards are all equal, whatever the estimator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from primerl.config.algorithms import EqualRewardsFilter, FilterConfig, ZeroAdvantageFilter
from primerl.orchestrator.advantages import is_zero_advantage


def no_signal(group: Any) -> bool:
    """Whether no rollout of the group (scored by `advantages.Scorer`) has a nonzero advantage on any token."""
    values: list[float] = []
    for advantage in group.sample_advantages:
        if advantage is not None:
            values.extend(advantage if isinstance(advantage, list) else [advantage])
    return is_zero_advantage(values)


def equal_rewards(group: Any, tolerance: float) -> bool:
    """Whether the group's scored rollouts' rewards all lie within `tolerance` of each other."""
    rewards = list(group.scored_rewards.values())
    return not rewards or max(rewards) - min(rewards) <= tolerance


class GroupFilters:
    """The configured filters, asked in order."""

    def __init__(self, configs: Sequence[FilterConfig]):
        self.configs = list(configs)

    @property
    def names(self) -> list[str]:
        return [cfg.type for cfg in self.configs]

    def dropping(self, group: Any) -> str | None:
        """The type of the first filter that drops `group`, or None."""
        for cfg in self.configs:
            if isinstance(cfg, ZeroAdvantageFilter) and no_signal(group):
                return cfg.type
            if isinstance(cfg, EqualRewardsFilter) and equal_rewards(group, cfg.tolerance):
                return cfg.type
        return None
