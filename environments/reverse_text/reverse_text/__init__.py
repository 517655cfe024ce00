"""reverse-text: reverse a short phrase character by character (single turn).

Phrases are drawn deterministically from the shipped word list with `random.Random(seed)`; the word list is pinned by
sha256, and the default split (seed 0, 1000 phrases) by the sha256 of its rows. Reward: difflib's SequenceMatcher
ratio between the reply and the reversed phrase (1.0 = exact).
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator

import verifiers.v1 as vf

from primerl.orchestrator.envkit import ChatHarness, read_pinned, verify_generated

WORDS_SHA256 = "dbbf56e6e02e6964fd7830d5a9846fbf0464379576573466cd8841d4b6298792"
DEFAULT_SPLIT_SHA256 = "ca0395e91f07163f5a723204a72084eb0455114387118c17486f10f8cc875435"
SYSTEM_PROMPT = "Reverse the text you are given, character by character. Reply with the reversed text only."


class ReverseTextConfig(vf.TasksetConfig):
    seed: int = 0
    """Seed of the phrase generator."""
    num_examples: int = 1000
    """Phrases generated."""
    min_words: int = 2
    """Fewest words in a phrase."""
    max_words: int = 5
    """Most words in a phrase."""


class ReverseTextData(vf.TaskData):
    text: str
    """The phrase to reverse."""


class ReverseTextTask(vf.Task[ReverseTextData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def reversal_similarity(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return reversal_similarity(trace.last_reply, task.text)


def reversal_similarity(reply: str, text: str) -> float:
    """SequenceMatcher ratio of `reply` (stripped) to `text` reversed."""
    return difflib.SequenceMatcher(None, reply.strip(), text[::-1]).ratio()


def generate_phrases(words: list[str], seed: int, count: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words))) for _ in range(count)]


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> Iterator[ReverseTextTask]:
        c = self.config
        words = read_pinned(__name__, "data/words.txt", WORDS_SHA256).decode().split()
        phrases = generate_phrases(words, c.seed, c.num_examples, c.min_words, c.max_words)
        verify_generated(c, phrases, DEFAULT_SPLIT_SHA256)
        for i, phrase in enumerate(phrases):
            yield ReverseTextTask(
                ReverseTextData(
                    id=f"reverse-text-{c.seed}-{i}", prompt=phrase, system_prompt=SYSTEM_PROMPT, text=phrase
                ),
                c.task,
            )


__all__ = ["ChatHarness", "ReverseTextConfig", "ReverseTextData", "ReverseTextTask", "ReverseTextTaskset"]
