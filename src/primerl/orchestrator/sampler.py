"""Which task each group runs: the task samplers of `[orchestrator.sampler]`.

Contract: a sampler hands out tasks with their draw index (`next() -> (draw, task)`, draws numbered from 0), counts
them (`drawn`), and on a resumed run first hands out again the draws whose groups were lost (`redo`, in order,
under their original indices). It sees every finished group (`observe`), and `state(in_flight)` is what the
orchestrator checkpoint must hold (JSON) for a resumed run to draw exactly what this one would: with it, a sampler
rebuilt by `task_sampler` from the checkpoint's progress continues with the same draws.

- `TaskStream` (`uniform`): the environment's tasks in a seeded order; its state is the draw count alone.
- `DifficultyTaskSampler` (`difficulty`): draw d picks a task at random (a generator seeded by the run's seed and d)
  with probability proportional to its weight: `easy_weight` when every rollout of its last observed group reached
  `solved_at`, `hard_weight` when none did, 1 otherwise and for unseen tasks ("last" = highest draw index, so the
  order groups finish in does not matter). Its state: each task's last outcome and the task of each draw in flight.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Any

from primerl.config.algorithms import DifficultySampler, SamplerConfig


class TaskStream:
    """The environment's tasks in a seeded order: a fresh shuffle each pass over a finite taskset, the taskset's own
    order for an infinite one. `drawn` counts tasks handed out and `next` returns each with its draw index, so a
    resumed run continues where it stopped: first the draws in `redo` (tasks whose groups were lost), then new ones."""

    def __init__(self, taskset: Any, seed: int, drawn: int = 0, redo: Sequence[int] = ()):
        self.drawn = drawn
        self._seed = seed
        self._tasks = list(taskset) if taskset.bounded else None
        if self._tasks is not None and not self._tasks:
            raise ValueError("the environment has no tasks")
        self._epoch, self._order = -1, []
        self._redo: deque[tuple[int, Any]] = deque()
        self._infinite = iter(taskset) if self._tasks is None else None
        wanted = set(redo)
        if self._infinite is not None:
            for index in range(drawn):
                task = next(self._infinite)
                if index in wanted:
                    self._redo.append((index, task))
        else:
            self._redo.extend((index, self._task_at(index)) for index in sorted(wanted))

    def __len__(self) -> int:
        return len(self._tasks) if self._tasks is not None else 0

    @property
    def redo_left(self) -> list[int]:
        """Draw indices still to be drawn again."""
        return [index for index, _ in self._redo]

    def next(self) -> tuple[int, Any]:
        """(draw index, task)."""
        if self._redo:
            return self._redo.popleft()
        self.drawn += 1
        if self._infinite is not None:
            return self.drawn - 1, next(self._infinite)
        return self.drawn - 1, self._task_at(self.drawn - 1)

    def _task_at(self, draw: int) -> Any:
        epoch, index = divmod(draw, len(self._tasks))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, list(range(len(self._tasks)))
            random.Random(f"{self._seed}:{epoch}").shuffle(self._order)
        return self._tasks[self._order[index]]

    def observe(self, group: Any) -> None:
        """The uniform order ignores outcomes."""

    def state(self, in_flight: Sequence[int]) -> dict[str, Any]:
        return {}

    def metrics(self) -> dict[str, Any]:
        return {}


EASY, HARD, MIXED = "easy", "hard", "mixed"


class DifficultyTaskSampler:
    """Draws tasks of a finite taskset less often when their last group was all solved or all unsolved (see the
    module docstring). `state` holds, for each task seen, the draw and outcome of its last observed group, and the
    task of each draw in flight."""

    def __init__(self, taskset: Any, cfg: DifficultySampler, seed: int, drawn: int = 0, redo: Sequence[int] = (),
                 state: dict[str, Any] | None = None):
        if not taskset.bounded:
            raise ValueError("sampler.type = 'difficulty' needs a finite taskset (this environment's is unbounded)")
        self._tasks = list(taskset)
        if not self._tasks:
            raise ValueError("the environment has no tasks")
        self.cfg = cfg
        self.drawn = drawn
        self._seed = seed
        state = state or {}
        self._outcome: dict[int, tuple[int, str]] = {
            int(task): (int(draw), outcome) for task, (draw, outcome) in state.get("outcome", {}).items()}
        self._task_of_draw: dict[int, int] = {int(d): int(t) for d, t in state.get("task_of_draw", {}).items()}
        missing = sorted(set(redo) - set(self._task_of_draw))
        if missing:
            raise ValueError(f"the checkpoint's sampler state does not say which tasks draws {missing} ran")
        self._redo: deque[int] = deque(sorted(redo))

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def redo_left(self) -> list[int]:
        return list(self._redo)

    def weight(self, task: int) -> float:
        outcome = self._outcome.get(task, (0, MIXED))[1]
        return {EASY: self.cfg.easy_weight, HARD: self.cfg.hard_weight}.get(outcome, 1.0)

    def next(self) -> tuple[int, Any]:
        """(draw index, task). When every weight is 0 (all tasks easy or hard, both weights 0) tasks are drawn
        uniformly: a run never stalls on its sampler."""
        if self._redo:
            draw = self._redo.popleft()
            return draw, self._tasks[self._task_of_draw[draw]]
        draw = self.drawn
        self.drawn += 1
        weights = [self.weight(task) for task in range(len(self._tasks))]
        if not any(weights):
            weights = [1.0] * len(weights)
        task = random.Random(f"{self._seed}:difficulty:{draw}").choices(range(len(self._tasks)), weights)[0]
        self._task_of_draw[draw] = task
        return draw, self._tasks[task]

    def observe(self, group: Any) -> None:
        """Record the outcome of a finished group (its rollouts that did not fail; nothing when all failed)."""
        task = self._task_of_draw.get(group.draw)
        rewards: dict[str, float] = {}
        for s in group.samples:
            if s.error is None:
                rewards.setdefault(s.trace_id, float(s.reward))
        if task is None or not rewards:
            return
        solved = [r >= self.cfg.solved_at for r in rewards.values()]
        outcome = EASY if all(solved) else HARD if not any(solved) else MIXED
        if task not in self._outcome or self._outcome[task][0] <= group.draw:
            self._outcome[task] = (group.draw, outcome)

    def state(self, in_flight: Sequence[int]) -> dict[str, Any]:
        """JSON: every task's last outcome, and the tasks of the draws in `in_flight` (the others are consumed and
        forgotten)."""
        keep = set(in_flight)
        self._task_of_draw = {d: t for d, t in self._task_of_draw.items() if d in keep or d in self._redo}
        return {
            "outcome": {str(task): [draw, outcome] for task, (draw, outcome) in sorted(self._outcome.items())},
            "task_of_draw": {str(d): t for d, t in sorted(self._task_of_draw.items()) if d in keep},
        }

    def metrics(self) -> dict[str, Any]:
        outcomes = [outcome for _, outcome in self._outcome.values()]
        return {"tasks_easy": outcomes.count(EASY), "tasks_hard": outcomes.count(HARD),
                "tasks_unseen": len(self._tasks) - len(outcomes)}


TaskSampler = TaskStream | DifficultyTaskSampler


def task_sampler(cfg: SamplerConfig, taskset: Any, seed: int, drawn: int = 0, redo: Sequence[int] = (),
                 state: dict[str, Any] | None = None) -> TaskSampler:
    """The sampler `cfg` selects, continuing after `drawn` draws with `redo` first and the checkpoint's `state`."""
    if isinstance(cfg, DifficultySampler):
        return DifficultyTaskSampler(taskset, cfg, seed, drawn, redo, state)
    return TaskStream(taskset, seed, drawn, redo)
