"""alphabet-sort: keep a list of names sorted while new names arrive (multi-turn, 3-5 turns).

Turn 1 gives a few names to sort; each later user turn adds more, and the model must answer with the full list sorted
again. Name batches are drawn deterministically from the shipped name list (pinned by sha256) with
`random.Random(seed)`. Reward: the mean over all turns of the SequenceMatcher ratio between the names in the reply and
the expected sorted list; a turn the model never answered scores 0.
"""

from __future__ import annotations

import difflib
import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

from primerl.orchestrator.envkit import ChatHarness, read_pinned, verify_generated

NAMES_SHA256 = "bdaea1fe9ee6980c385cc61d0437a8debe09a7579a7cd63cb7799facaf20157b"
DEFAULT_SPLIT_SHA256 = "34c0f6096cd4af70104b8d528410457753947122c55adddca71063acfb819869"
SYSTEM_PROMPT = (
    "You keep a list of names in alphabetical order. Every time you are given names, reply with the complete list "
    "so far, sorted alphabetically, one name per line, and nothing else."
)
_LIST_MARKER = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s*")


class AlphabetSortConfig(vf.TasksetConfig):
    seed: int = 0
    """Seed of the batch generator."""
    num_examples: int = 500
    """Tasks generated."""
    min_turns: int = 3
    """Fewest user turns (batches) in a task."""
    max_turns: int = 5
    """Most user turns (batches) in a task."""
    first_batch: tuple[int, int] = (3, 5)
    """Names in the first turn (inclusive range)."""
    later_batch: tuple[int, int] = (1, 3)
    """Names added in each later turn (inclusive range)."""


class AlphabetSortData(vf.TaskData):
    batches: list[list[str]]
    """Names revealed per turn; the first batch is in the prompt."""


def batch_prompt(names: list[str], first: bool) -> str:
    listed = ", ".join(names)
    if first:
        return f"Sort these names alphabetically: {listed}"
    return f"Add these names and reply with the whole list sorted again: {listed}"


def parse_names(reply: str) -> list[str]:
    """Names in a reply: one per line (or comma-separated), list markers dropped."""
    items = (part for line in reply.splitlines() for part in line.split(","))
    return [name for item in items if (name := _LIST_MARKER.sub("", item).strip())]


def turn_scores(replies: list[str], batches: list[list[str]]) -> list[float]:
    """Per turn, the similarity of the reply's names to the sorted names revealed so far (0 when unanswered)."""
    scores = []
    for turn in range(len(batches)):
        expected = sorted(name for batch in batches[: turn + 1] for name in batch)
        reply = replies[turn] if turn < len(replies) else None
        scores.append(0.0 if reply is None else difflib.SequenceMatcher(None, parse_names(reply), expected).ratio())
    return scores


class AlphabetSortTask(vf.Task[AlphabetSortData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def sorted_lists(self, task: AlphabetSortData, trace: vf.Trace) -> float:
        replies = [message.content or "" for message in trace.assistant_messages]
        scores = turn_scores(replies, task.batches)
        return sum(scores) / len(scores)


def generate_batches(names: list[str], config: AlphabetSortConfig) -> list[list[list[str]]]:
    rng = random.Random(config.seed)
    tasks = []
    for _ in range(config.num_examples):
        turns = rng.randint(config.min_turns, config.max_turns)
        sizes = [rng.randint(*config.first_batch)] + [rng.randint(*config.later_batch) for _ in range(turns - 1)]
        drawn = rng.sample(names, sum(sizes))
        batches, start = [], 0
        for size in sizes:
            batches.append(drawn[start : start + size])
            start += size
        tasks.append(batches)
    return tasks


class AlphabetSortTaskset(vf.Taskset[AlphabetSortTask, AlphabetSortConfig]):
    def load(self) -> Iterator[AlphabetSortTask]:
        names = read_pinned(__name__, "data/names.txt", NAMES_SHA256).decode().split()
        tasks = generate_batches(names, self.config)
        verify_generated(self.config, tasks, DEFAULT_SPLIT_SHA256)
        for i, batches in enumerate(tasks):
            yield AlphabetSortTask(
                AlphabetSortData(
                    id=f"alphabet-sort-{self.config.seed}-{i}",
                    prompt=batch_prompt(batches[0], first=True),
                    system_prompt=SYSTEM_PROMPT,
                    batches=batches,
                ),
                self.config.task,
            )


class AlphabetSortEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class AlphabetSortEnv(vf.Env[AlphabetSortEnvConfig]):
    """Plays the user: after each reply, reveals the next batch of names until all batches are out."""

    async def run(self, task: AlphabetSortTask, agents: vf.Agents) -> None:
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for batch in task.data.batches[1:]:
                if segment.terminated:
                    break
                segment = await interaction.turn(batch_prompt(batch, first=False))


__all__ = [
    "AlphabetSortConfig",
    "AlphabetSortData",
    "AlphabetSortEnv",
    "AlphabetSortEnvConfig",
    "AlphabetSortTask",
    "AlphabetSortTaskset",
    "ChatHarness",
]
