"""wordle: guess a hidden five-letter word in at most six guesses, with feedback after each (multi-turn).

Secret words come from the shipped word list (pinned by sha256), one task per word. After each guess the environment
answers with per-letter feedback: G = right letter in the right place, Y = in the word elsewhere, X = not in the word
(repeated letters count only as often as the secret has them). Reward: 1.0 for solving; otherwise half the best
guess's letter credit (greens count 1, yellows 0.5, divided by 5).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import verifiers.v1 as vf

from primerl.orchestrator.envkit import ChatHarness, read_pinned

WORDS_SHA256 = "3d7667fe26e19acc23bc201e991d576e6243c5d26f797a62247748cc6a5fb44c"
WORD_LENGTH = 5
SYSTEM_PROMPT = (
    "You are playing Wordle. Guess the hidden five-letter English word. After each guess you get feedback per "
    "letter: G = right letter in the right place, Y = the letter is in the word but elsewhere, X = not in the word. "
    "Reply with exactly one guess written in square brackets, like [crane]."
)
_GUESS = re.compile(r"\[\s*([A-Za-z]{5})\s*\]")


def parse_guess(reply: str) -> str | None:
    """The first bracketed five-letter word in a reply, lowercased; None when there is none."""
    match = _GUESS.search(reply)
    return match.group(1).lower() if match else None


def feedback(secret: str, guess: str) -> str:
    """Per-letter marks for `guess` against `secret`: G (green), Y (yellow), X (gray)."""
    marks = ["X"] * WORD_LENGTH
    unmatched = Counter(s for s, g in zip(secret, guess, strict=True) if s != g)
    for i, (s, g) in enumerate(zip(secret, guess, strict=True)):
        if s == g:
            marks[i] = "G"
        elif unmatched[g] > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


def letter_credit(marks: str) -> float:
    return (marks.count("G") + 0.5 * marks.count("Y")) / WORD_LENGTH


def game_reward(secret: str, replies: list[str]) -> float:
    """1.0 when some guess is the secret, else half the best guess's letter credit (invalid guesses earn 0)."""
    guesses = [guess for reply in replies if (guess := parse_guess(reply)) is not None]
    if secret in guesses:
        return 1.0
    return 0.5 * max((letter_credit(feedback(secret, guess)) for guess in guesses), default=0.0)


class WordleConfig(vf.TasksetConfig):
    max_guesses: int = 6
    """Guesses allowed per game."""


class WordleData(vf.TaskData):
    secret: str
    max_guesses: int


class WordleTask(vf.Task[WordleData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def solved_or_letters(self, task: WordleData, trace: vf.Trace) -> float:
        return game_reward(task.secret, [message.content or "" for message in trace.assistant_messages])

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class WordleTaskset(vf.Taskset[WordleTask, WordleConfig]):
    def load(self) -> Iterator[WordleTask]:
        words = read_pinned(__name__, "data/words.txt", WORDS_SHA256).decode().split()
        prompt = f"Start the game: make your first guess. You have {self.config.max_guesses} guesses."
        for word in words:
            yield WordleTask(
                WordleData(
                    id=f"wordle-{word}",
                    prompt=prompt,
                    system_prompt=SYSTEM_PROMPT,
                    secret=word,
                    max_guesses=self.config.max_guesses,
                ),
                self.config.task,
            )


def turn_message(secret: str, guess: str | None, guesses_left: int) -> str:
    """The environment's answer to one guess."""
    if guess is None:
        return (
            f"Invalid guess: reply with one five-letter word in square brackets, like [crane]. "
            f"{guesses_left} guesses left."
        )
    return f"{guess.upper()} -> {' '.join(feedback(secret, guess))}. {guesses_left} guesses left."


class WordleEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class WordleEnv(vf.Env[WordleEnvConfig]):
    """Plays the game master: scores each guess and answers with feedback until solved or out of guesses."""

    async def run(self, task: WordleTask, agents: vf.Agents) -> None:
        secret, allowed = task.data.secret, task.data.max_guesses
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for used in range(1, allowed + 1):
                if segment.terminated:
                    break
                guess = parse_guess(segment.last_reply)
                if guess == secret or used == allowed:
                    break
                segment = await interaction.turn(turn_message(secret, guess, allowed - used))


__all__ = ["ChatHarness", "WordleConfig", "WordleData", "WordleEnv", "WordleEnvConfig", "WordleTask", "WordleTaskset"]
