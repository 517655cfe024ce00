"""probe-harnessed: a taskset with its own harness, written against verifiers alone.

`OneCallHarness` makes exactly one chat call to the rollout's interception endpoint, in the orchestrator's process
(it runs no program and offers no tools, hence `EXECUTES_CODE = False`). Each task asks for a number's successor;
reward 1.0 when the reply contains it.
"""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf
from openai import APIError, AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult


class NextData(vf.TaskData):
    answer: str


class NextTask(vf.Task[NextData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: NextData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply)


class NextTaskset(vf.Taskset[NextTask, vf.TasksetConfig]):
    def load(self) -> Iterator[NextTask]:
        for n in range(6):
            yield NextTask(
                NextData(id=f"next-{n}", prompt=f"What number comes after {n}?", system_prompt="Answer with a number.",
                         answer=str(n + 1)),
                self.config.task,
            )


class OneCallHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            try:
                await client.chat.completions.create(model=ctx.model, messages=messages)
            except APIError as error:
                return ProgramResult(exit_code=1, stdout="", stderr=f"{type(error).__name__}: {error}")
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["NextData", "NextTask", "NextTaskset", "OneCallHarness"]
