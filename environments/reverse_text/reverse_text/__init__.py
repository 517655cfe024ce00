"""reverse-text: reverse a short phrase, character by character or word by word (single turn).

Phrases are drawn deterministically from the shipped word list with `random.Random(seed)`; the word list is pinned by
sha256, and the default split (seed 0, 1000 phrases) by the sha256 of its rows. `reverse = "chars"` (the default)
asks for the phrase reversed letter by letter, `reverse = "words"` for its words in reverse order. Reward: difflib's
SequenceMatcher ratio between the reply and the reversed phrase (1.0 = exact).
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf

from primerl.orchestrator.envkit import ChatHarness, read_pinned, verify_generated

WORDS_SHA256 = "dbbf56e6e02e6964fd7830d5a9846fbf0464379576573466cd8841d4b6298792"
DEFAULT_SPLIT_SHA256 = "ca0395e91f07163f5a723204a72084eb0455114387118c17486f10f8cc875435"
SYSTEM_PROMPT = "Reverse the text you are given, character by character. Reply with the reversed text only."
SYSTEM_PROMPT_WORDS = "Reverse the order of the words you are given. Reply with the words only."
SYSTEM_PROMPTS = {"chars": SYSTEM_PROMPT, "words": SYSTEM_PROMPT_WORDS}

Reverse = Literal["chars", "words"]
"""What a task reverses: the phrase's characters, or the order of its words."""


class ReverseTextConfig(vf.TasksetConfig):
    seed: int = 0
    """Seed of the phrase generator."""
    num_examples: int = 1000
    """Phrases generated."""
    min_words: int = 2
    """Fewest words in a phrase."""
    max_words: int = 5
    """Most words in a phrase."""
    reverse: Reverse = "chars"
    """What is reversed: the phrase's characters ("chars") or the order of its words ("words")."""


class ReverseTextData(vf.TaskData):
    text: str
    """The phrase to reverse."""
    reverse: Reverse = "chars"
    """What is reversed: characters or the order of the words."""


class ReverseTextTask(vf.Task[ReverseTextData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def reversal_similarity(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return reversal_similarity(trace.last_reply, task.text, task.reverse)


def reversed_text(text: str, reverse: Reverse = "chars") -> str:
    """`text` reversed character by character, or its words (split on whitespace) in reverse order."""
    return text[::-1] if reverse == "chars" else " ".join(text.split()[::-1])


def reversal_similarity(reply: str, text: str, reverse: Reverse = "chars") -> float:
    """SequenceMatcher ratio of `reply` (stripped) to `text` reversed."""
    return difflib.SequenceMatcher(None, reply.strip(), reversed_text(text, reverse)).ratio()


def generate_phrases(words: list[str], seed: int, count: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words))) for _ in range(count)]


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> Iterator[ReverseTextTask]:
        c = self.config
        words = read_pinned(__name__, "data/words.txt", WORDS_SHA256).decode().split()
        phrases = generate_phrases(words, c.seed, c.num_examples, c.min_words, c.max_words)
        verify_generated(c, phrases, DEFAULT_SPLIT_SHA256, ignore=("reverse",))
        for i, phrase in enumerate(phrases):
            yield ReverseTextTask(
                ReverseTextData(
                    id=f"reverse-text-{c.seed}-{i}",
                    prompt=phrase,
                    system_prompt=SYSTEM_PROMPTS[c.reverse],
                    text=phrase,
                    reverse=c.reverse,
                ),
                c.task,
            )


__all__ = ["ChatHarness", "ReverseTextConfig", "ReverseTextData", "ReverseTextTask", "ReverseTextTaskset"]
