"""math-sanity: short competition-style problems with exact answers, checked by math-verify (single turn).

The 52 problems ship in `data/problems.jsonl` (pinned by sha256). The model must put its final answer in
`\\boxed{}`; reward 1.0 when math-verify finds it equivalent to the reference answer, else 0.0. (The package is not
named `math` because that would shadow Python's standard library module.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import verifiers.v1 as vf
from math_verify import parse, verify

from primerl.orchestrator.envkit import ChatHarness, read_pinned

PROBLEMS_SHA256 = "90b1168be69b992d1172ff050347581b909b1919ec4574e5aadc44a902be8033"
SYSTEM_PROMPT = "Solve the problem. Reason briefly, then give the final answer in \\boxed{}."


def answer_is_correct(reply: str, answer: str) -> bool:
    """Whether the reply's final answer is mathematically equivalent to the reference `answer`."""
    gold = parse(f"${answer}$")
    predicted = parse(reply)
    return bool(gold and predicted and verify(gold, predicted))


class MathData(vf.TaskData):
    answer: str
    """Reference answer, LaTeX without delimiters."""


class MathTask(vf.Task[MathData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct_answer(self, task: MathData, trace: vf.Trace) -> float:
        return float(answer_is_correct(trace.last_reply, task.answer))


class MathTaskset(vf.Taskset[MathTask, vf.TasksetConfig]):
    def load(self) -> Iterator[MathTask]:
        lines = read_pinned(__name__, "data/problems.jsonl", PROBLEMS_SHA256).decode().splitlines()
        for row in map(json.loads, lines):
            yield MathTask(
                MathData(id=row["id"], prompt=row["problem"], system_prompt=SYSTEM_PROMPT, answer=row["answer"]),
                self.config.task,
            )


__all__ = ["ChatHarness", "MathData", "MathTask", "MathTaskset"]
