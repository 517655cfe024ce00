"""probe-multiturn: a multi-turn environment (an `Env` that plays the user) with no harness of its own.

The user gives a word, then asks twice for it again; reward: the fraction of the three replies that contain it.
"""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf

WORDS = ["north", "south", "east", "west", "up", "down"]
FOLLOW_UPS = ["Say it again.", "Once more, please."]


class RepeatData(vf.TaskData):
    word: str


class RepeatTask(vf.Task[RepeatData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def repeated(self, task: RepeatData, trace: vf.Trace) -> float:
        replies = [message.content or "" for message in trace.assistant_messages]
        return sum(task.word in reply.lower() for reply in replies) / (1 + len(FOLLOW_UPS))


class RepeatTaskset(vf.Taskset[RepeatTask, vf.TasksetConfig]):
    def load(self) -> Iterator[RepeatTask]:
        for word in WORDS:
            yield RepeatTask(RepeatData(prompt=f"Remember the word {word} and say it.", word=word), self.config.task)


class RepeatEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class RepeatEnv(vf.Env[RepeatEnvConfig]):
    async def run(self, task: RepeatTask, agents: vf.Agents) -> None:
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for follow_up in FOLLOW_UPS:
                if segment.terminated:
                    break
                segment = await interaction.turn(follow_up)


__all__ = ["RepeatData", "RepeatEnv", "RepeatEnvConfig", "RepeatTask", "RepeatTaskset"]
