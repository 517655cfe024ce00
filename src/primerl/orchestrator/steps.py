"""Groups and batches: a task's scored rollouts (`Group`), the samples a batch is made of, and the record each
written batch adds to metrics.jsonl (`step_metrics`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from primerl.orchestrator import verifiers_bridge
from primerl.transport import rollouts as batches


@dataclass
class Group:
    """The scored rollouts of one task. `samples` are the bridge's samples (one or more per rollout); `rewards` has one
    entry per rollout (trace) that finished, failed ones included (they count in the reward metrics); `advantages` has
    one per rollout in the baseline, `scored_rewards` its (shaped) reward and `sample_advantages` each sample's own
    (`score`); `teacher_logprobs` are the teacher's scores of the samples by `id(sample)` (distillation)."""

    task_id: str | None
    samples: list[Any]
    rewards: list[float]
    advantages: dict[str, float]
    seconds: float
    draw: int = -1  # the task's draw index (TaskStream.next)
    teacher_logprobs: dict[int, list[float]] = field(default_factory=dict)
    scored_rewards: dict[str, float] = field(default_factory=dict)
    sample_advantages: list[Any] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return all(s.error is not None for s in self.samples)

    def score(self, scorer) -> None:
        """Advantages over the rollouts now in the group that did not fail (`advantages.Scorer`); after stale samples
        are dropped, the rollouts that remain are scored again among themselves."""
        scored = scorer(self.samples, self.teacher_logprobs)
        self.advantages, self.scored_rewards, self.sample_advantages = (
            scored.advantages, scored.rewards, scored.sample_advantages)


def score_group(task_id: str | None, samples: Sequence[Any], scorer, seconds: float,
                teacher_logprobs: dict[int, list[float]] | None = None) -> Group:
    """Advantages per rollout: the bridge may cut one rollout (trace) into several samples; they share its reward."""
    by_trace: dict[str, float] = {}
    for s in samples:
        by_trace.setdefault(s.trace_id, float(s.reward))
    group = Group(task_id, list(samples), list(by_trace.values()), {}, seconds,
                  teacher_logprobs=dict(teacher_logprobs or {}))
    group.score(scorer)
    return group


def trainable(sample: Any) -> bool:
    return bool(sample.input_ids) and any(sample.loss_mask)


def to_batch_sample(sample: Any, advantage: float) -> batches.Sample:
    return batches.Sample(
        input_ids=list(sample.input_ids),
        loss_mask=list(sample.loss_mask),
        inference_logprobs=list(sample.inference_logprobs),
        advantages=advantage,
        policy_versions=tuple(sample.policy_versions),
        version_segments=[list(run) for run in sample.version_segments],
        env=sample.env,
    )


@dataclass
class StepStats:
    """What happened while one step was the next to write: groups that finished but were not used (zero advantage,
    failed), samples dropped as too old, time spent waiting for the policy."""

    started: float = field(default_factory=time.monotonic)
    cpu_started: float = field(default_factory=time.process_time)
    workers_cpu_started: float | None = None
    unused_groups: list[Group] = field(default_factory=list)
    groups_dropped: dict[str, int] = field(default_factory=dict)  # by the type of the filter that dropped them
    samples_dropped_off_policy: int = 0
    samples_too_long: int = 0
    wait_for_policy_s: float = 0.0


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def step_metrics(step: int, groups: list[Group], samples: list[batches.Sample], meta: dict, stats: StepStats, *,
                 write_s: float, filter_names: Sequence[str], policy_version: int, weight_update_s: float | None,
                 workers_cpu_s: float | None, rollouts_this_run: int, sampled_tokens_this_run: int,
                 generation_s: float, rollouts_total: int, algorithm_metrics: dict[str, Any],
                 sampler_metrics: dict[str, Any]) -> dict[str, Any]:
    """The record of the batch of `step` (`meta`: its meta file). Rewards, lengths, truncation and errors are over
    every rollout of the batch plus the rollouts dropped while this step was being filled (so dropping groups of
    perfect scores does not hide progress); the rates are over this process's life (`generation_s`), tokens and
    rollouts included this step's."""
    step_s = time.monotonic() - stats.started
    seen = groups + stats.unused_groups
    rewards = [r for g in seen for r in g.rewards]
    rollouts = [s for g in seen for s in g.samples]  # every sample: a rollout cut in several has several
    per_rollout = verifiers_bridge.rollout_means([r for g in seen for r in verifiers_bridge.rollout_records(g.samples)])
    lags = [step - s.policy_versions[0] for s in samples]
    step_tokens = sum(sum(s.loss_mask) for s in samples)
    return {
        "reward_mean": _mean(rewards),
        "reward_std": statistics.pstdev(rewards) if rewards else None,
        "reward_min": min(rewards, default=None),
        "reward_max": max(rewards, default=None),
        "batch_reward_mean": _mean([r for g in groups for r in g.rewards]),
        "samples": len(samples),
        **per_rollout,  # rollouts, turns, completion_len, truncated_frac, metric/<name>: per rollout
        "seq_len_mean": _mean([len(s.input_ids) for s in samples]),
        "samples_too_long": stats.samples_too_long,
        "errors": sum(s.error is not None for s in rollouts),
        **{f"groups_dropped_{name}": stats.groups_dropped.get(name, 0) for name in filter_names},
        "samples_dropped_off_policy": stats.samples_dropped_off_policy,
        "policy_version": policy_version,
        "policy_lag_mean": _mean(lags),
        "policy_lag_max": max(lags, default=None),
        "oldest_policy_version": min((s.policy_versions[0] for s in samples), default=None),
        "samples_spanning_updates": sum(s.policy_versions[0] != s.policy_versions[1] for s in samples),
        "step_s": step_s,
        "cpu_s": time.process_time() - stats.cpu_started,
        "workers_cpu_s": workers_cpu_s,
        "wait_for_policy_s": stats.wait_for_policy_s,
        "write_s": write_s,
        "weight_update_s": weight_update_s,
        "rollouts_per_s": rollouts_this_run / generation_s if generation_s > 0 else None,
        "tokens_per_s": sampled_tokens_this_run / generation_s if generation_s > 0 else None,
        "step_tokens_per_s": step_tokens / step_s if step_s > 0 else None,  # this step's alone
        "rows": meta["rows_per_rank"] * meta["num_ranks"],
        "loss_tokens": meta["num_loss_tokens"],
        "rollouts_total": rollouts_total,
        **algorithm_metrics,
        **sampler_metrics,
    }
