"""probe-taskset: a taskset and nothing else (the common single-turn shape; no harness of its own).

Each task asks the model to say one word; reward 1.0 when the reply contains it.
"""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf

WORDS = ["amber", "basil", "cedar", "delta", "ember", "fjord", "gecko", "hazel"]


class SayData(vf.TaskData):
    word: str


class SayTask(vf.Task[SayData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def said_it(self, task: SayData, trace: vf.Trace) -> float:
        return float(task.word in trace.last_reply.lower())


class SayTaskset(vf.Taskset[SayTask, vf.TasksetConfig]):
    def load(self) -> Iterator[SayTask]:
        for word in WORDS:
            yield SayTask(SayData(prompt=f"Say the word {word}.", word=word), self.config.task)


__all__ = ["SayData", "SayTask", "SayTaskset"]
