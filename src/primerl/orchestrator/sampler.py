"""Which task each group runs: the task samplers of `orchestrator.sampler`.

Contract: a sampler hands out tasks with their draw index (`next() -> (draw, task)`, draws numbered from 0), counts
them (`drawn`), and on a resumed run first hands out again the draws whose groups were lost (`redo`, in order,
under their original indices). `TaskStream` is the uniform one: the environment's tasks in a seeded order.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Any


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
