"""The async rule (docs/rl.md, "The async rule") as arithmetic: which steps the policy inference holds may generate
for, how many groups may be in flight, and which finished samples are too old to train on.

Step numbering: `rollouts/step_<n>` is trained on by the trainer holding policy version n (n optimizer steps done), so
with `max_async_steps = A`:
- rollouts for step n may start only once inference holds a policy version >= n - A (A = 0: exactly version n,
  fully synchronous; A = 1: generation for step n overlaps the trainer's step n - 1);
- a sample whose oldest policy version is below n - `off_policy_limit` is dropped from step n and counted
  (`off_policy_limit` defaults to A, so every sample in every batch obeys the rule).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyBound:
    max_async_steps: int
    off_policy_limit: int

    def __post_init__(self) -> None:
        if self.max_async_steps < 0 or self.off_policy_limit < self.max_async_steps:
            raise ValueError(
                f"need 0 <= max_async_steps ({self.max_async_steps}) <= off_policy_limit ({self.off_policy_limit})"
            )

    def min_version(self, step: int) -> int:
        """The oldest policy version that may start rollouts for `step`."""
        return max(0, step - self.max_async_steps)

    def last_step(self, version: int) -> int:
        """The furthest step the policy `version` may generate rollouts for."""
        return version + self.max_async_steps

    def is_fresh(self, step: int, oldest_version: int) -> bool:
        """Whether a sample that started under `oldest_version` may still go into `step`'s batch."""
        return oldest_version >= step - self.off_policy_limit

    def launch_budget(
        self, version: int, next_step: int, tasks_per_step: int, in_flight: int, ready: int, max_in_flight: int | None,
        first_batch: bool = False,
    ) -> int:
        """How many more groups may start now.

        Groups are counted against the steps `version` may generate for (`next_step` .. `last_step(version)`):
        groups in flight plus finished groups waiting for a batch must not exceed what those steps take, and at most
        `max_in_flight` run at once. While the run's `first_batch` is not yet written only its step is open: the
        trainer has nothing to do before it, and groups of later steps would share the engine with it.
        """
        steps_open = self.last_step(version) - next_step + 1
        if first_batch:
            steps_open = min(steps_open, 1)
        budget = max(0, steps_open * tasks_per_step - in_flight - ready)
        if max_in_flight is not None:
            budget = min(budget, max(0, max_in_flight - in_flight))
        return budget
