"""The orchestrator's algorithm, put together from the config's choices (docs/algorithms.md): the reward shaping and
advantage estimator that score a group (`advantages.Scorer`, `shaping`), the filters that drop groups (`filters`), and
the teacher that scores sampled tokens for distillation (`teacher`). The task sampler is built apart
(`sampler.task_sampler`): it depends on the environment's taskset.

The loop calls: `await start()` / `await close()`, `await teacher_logprobs(samples)` before scoring a group,
`scorer(samples, teacher_logprobs)` to score it, `filters.dropping(group)` when it finishes, and
`step_metrics(groups)` for the metrics of each batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from primerl.config.orchestrator import OrchestratorConfig
from primerl.orchestrator.advantages import Scorer
from primerl.orchestrator.filters import GroupFilters
from primerl.orchestrator.shaping import RewardShaping
from primerl.orchestrator.teacher import Teacher


class Algorithm:
    def __init__(self, cfg: OrchestratorConfig):
        shaping = RewardShaping(cfg.shaping, cfg.sampling.max_tokens) if cfg.shaping else None
        self.scorer = Scorer(cfg.advantage, shaping)
        self.filters = GroupFilters(cfg.filters)
        self.teacher: Teacher | None = None
        if cfg.advantage.type == "distill":
            self.teacher = Teacher(cfg.teacher, cfg.client.request_timeout_s, cfg.client.retry_s)
        self.startup_timeout_s = cfg.client.startup_timeout_s
        self.description = ", ".join([
            f"advantage {cfg.advantage.type}",
            f"shaping {'+'.join(s.type for s in cfg.shaping) or 'none'}",
            f"filters {'+'.join(self.filters.names) or 'none'}",
            f"sampler {cfg.sampler.type}",
            *([f"teacher {cfg.teacher.model} at {cfg.teacher.base_url}"] if self.teacher else []),
        ])

    async def start(self) -> None:
        if self.teacher is not None:
            await self.teacher.wait_until_serving(self.startup_timeout_s)

    async def close(self) -> None:
        if self.teacher is not None:
            await self.teacher.close()

    async def teacher_logprobs(self, samples: Sequence[Any]) -> dict[int, list[float]]:
        """The teacher's log-probs of each sample's tokens by `id(sample)` (empty without a teacher)."""
        return await self.teacher.score(samples) if self.teacher is not None else {}

    def step_metrics(self, groups: Sequence[Any]) -> dict[str, Any]:
        """With a teacher: `teacher_kl`, the mean over the batch's sampled tokens of log p_sampler - log p_teacher
        (the reverse KL to the teacher, estimated on the student's own samples)."""
        if self.teacher is None:
            return {}
        gaps = [sampler - teacher
                for g in groups for s in g.samples if id(s) in g.teacher_logprobs
                for sampled, sampler, teacher in zip(s.loss_mask, s.inference_logprobs, g.teacher_logprobs[id(s)])
                if sampled]
        return {"teacher_kl": math.fsum(gaps) / len(gaps) if gaps else None}
