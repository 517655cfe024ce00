"""probe-tools: a tool environment whose tool runs code: primerl's `ShellHarness` gives the model a `shell` tool that
runs in the rollout's runtime, so it needs a sandbox (`--env.runtime.type docker`) unless unsandboxed tools are allowed.

Each task asks for the output of a shell arithmetic expression; reward 1.0 when the reply contains the value.
"""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf

from primerl.orchestrator.envkit import ShellHarness

SYSTEM_PROMPT = "You have a shell tool. Use it to compute the answer, then reply with the number only."


class ShellData(vf.TaskData):
    answer: str


class ShellTask(vf.Task[ShellData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ShellData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply)


class ShellTaskset(vf.Taskset[ShellTask, vf.TasksetConfig]):
    def load(self) -> Iterator[ShellTask]:
        for a, b in [(6, 7), (12, 12), (9, 11), (25, 4)]:
            yield ShellTask(
                ShellData(id=f"product-{a}x{b}", prompt=f"What does `echo $(({a}*{b}))` print?",
                          system_prompt=SYSTEM_PROMPT, answer=str(a * b)),
                self.config.task,
            )


__all__ = ["ShellData", "ShellHarness", "ShellTask", "ShellTaskset"]
