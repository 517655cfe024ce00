"""Write the SFT datasets that recipes pin under `[pins.data]`, from the environments' own pinned word lists.

    uv run python recipes/data/generate_sft_data.py [OUT_DIR]     (default: the directory of this script)

- `reverse-text-sft.jsonl`: 1000 reverse-text conversations (system prompt, phrase, the phrase reversed), phrases drawn
  with seed 1 — the RL stage samples the environment's seed-0 split, so SFT and RL phrases differ.
- `wordle-sft.jsonl`: every secret of the wordle word list played three times (three seeded guess orders) by a solver
  that always guesses the first word consistent with all feedback so far, with the environment's own prompts and
  feedback messages; only solved games are kept.

The output is deterministic: the same bytes on every machine, which is what the recipes' sha256 pins check.
"""

from __future__ import annotations

import json
import random
import sys
from importlib import resources
from pathlib import Path

from primerl.demo import reverse_text_conversations


def wordle_conversations(rounds: int = 3, seed: int = 1, max_guesses: int = 6) -> list[list[dict[str, str]]]:
    import wordle

    words = (resources.files("wordle") / "data/words.txt").read_text().split()
    rng = random.Random(seed)
    games = []
    for secret, order in ((s, o) for o in _shuffled_orders(words, rounds, rng) for s in words):
        messages = [
            {"role": "system", "content": wordle.SYSTEM_PROMPT},
            {"role": "user", "content": f"Start the game: make your first guess. You have {max_guesses} guesses."},
        ]
        candidates = order
        for used in range(1, max_guesses + 1):
            guess = candidates[0]
            messages.append({"role": "assistant", "content": f"[{guess}]"})
            if guess == secret or used == max_guesses:
                break
            marks = wordle.feedback(secret, guess)
            candidates = [w for w in candidates if wordle.feedback(w, guess) == marks]
            messages.append({"role": "user", "content": wordle.turn_message(secret, guess, max_guesses - used)})
        if messages[-1]["content"] == f"[{secret}]":  # keep solved games only: SFT shows good play
            games.append(messages)
    return games


def _shuffled_orders(words: list[str], rounds: int, rng: random.Random) -> list[list[str]]:
    orders = []
    for _ in range(rounds):
        order = sorted(words)
        rng.shuffle(order)
        orders.append(order)
    return orders


def write_jsonl(path: Path, conversations: list[list[dict[str, str]]]) -> None:
    path.write_text("".join(json.dumps({"messages": c}, sort_keys=True) + "\n" for c in conversations))


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "reverse-text-sft.jsonl", reverse_text_conversations(count=1000, seed=1))
    write_jsonl(out / "wordle-sft.jsonl", wordle_conversations())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
