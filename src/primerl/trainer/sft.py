"""`primerl sft`: supervised fine-tuning on chat conversations, loss on assistant tokens only.

Data: conversations ({"messages": [{"role", "content"}, ...]}) from a JSONL file or a `datasets` file, or a generated
word-reversal set (`data.fake`). Each conversation is rendered with the model's chat template; the loss mask covers
exactly the characters each assistant turn adds to the rendered text (its content and end-of-turn marker), found by
rendering the conversation prefix by prefix. Conversations are packed into rows of `data.seq_len` tokens with the RL
batch packing (primerl.transport.rollouts), so attention never crosses conversations. Steps consume
`data.rows_per_step` rows; the data position (epoch, row) is part of the checkpoint. `train.max_steps` unset = one
epoch. The loss is the mean negative log-likelihood over all assistant tokens of the step.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from primerl.config import config_from_argv
from primerl.config.sft import SFTConfig, SFTDataConfig
from primerl.cpu import keep_freed_memory
from primerl.trainer.core import MicroBatch, Trainer, TrainerParts, micro_batches, setup_logging
from primerl.trainer.dist import wants_cuda
from primerl.trainer.loss import LossOutput
from primerl.trainer.model import PolicyOutput
from primerl.transport.rollouts import Sample, pack_samples, split_rows

log = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]


def load_conversations(cfg: SFTDataConfig, seed: int) -> list[Conversation]:
    if cfg.fake:
        return fake_conversations(cfg.fake_conversations, seed)
    path = Path(cfg.path)
    if not path.exists():
        raise FileNotFoundError(f"data.path {path} does not exist")
    if path.suffix == ".jsonl":
        with path.open() as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        import datasets

        if path.is_dir():
            records = datasets.load_from_disk(str(path))
        else:
            kind = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}.get(path.suffix)
            if kind is None:
                raise ValueError(f"data.path {path}: expected .jsonl, .json, .parquet, .arrow or a dataset directory")
            records = datasets.load_dataset(kind, data_files=str(path), split="train")
    conversations = []
    for i, record in enumerate(records):
        messages = record.get(cfg.messages_field)
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}: record {i} has no list in {cfg.messages_field!r}")
        conversations.append(messages)
    return conversations


def fake_conversations(count: int, seed: int) -> list[Conversation]:
    """'Reverse these words' conversations over a small fixed vocabulary: learnable, so the loss visibly drops."""
    rng = random.Random(seed)
    words = [
        "red",
        "green",
        "blue",
        "cat",
        "dog",
        "sun",
        "moon",
        "tree",
        "rock",
        "fish",
        "bird",
        "star",
        "hill",
        "lake",
        "road",
    ]
    out = []
    for _ in range(count):
        chosen = rng.sample(words, rng.randint(2, 5))
        out.append(
            [
                {"role": "system", "content": "Reverse the order of the words."},
                {"role": "user", "content": " ".join(chosen)},
                {"role": "assistant", "content": " ".join(reversed(chosen))},
            ]
        )
    return out


def tokenize_conversation(tokenizer, messages: Conversation) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask that is 1 on the tokens of assistant turns."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError("the chat template does not render conversations prefix by prefix; cannot mask turns")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def conversation_samples(tokenizer, conversations: list[Conversation]) -> list[Sample]:
    samples = []
    for messages in conversations:
        ids, mask = tokenize_conversation(tokenizer, messages)
        if sum(mask) == 0 or mask[0]:
            continue
        samples.append(Sample(ids, mask, [0.0] * len(ids), 0.0))
    if not samples:
        raise ValueError("no conversation has an assistant turn to train on")
    return samples


class PackedEpochs:
    """Packed rows in a seeded order per epoch; `take(n)` returns the next rows and advances (epoch, row)."""

    def __init__(self, samples: list[Sample], seq_len: int, shuffle: bool, seed: int, pad_token_id: int):
        self.rows = pack_samples(samples, seq_len, pad_token_id).arrays
        self.num_rows = self.rows["input_ids"].shape[0]
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.row = 0, 0

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "row": self.row}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.row = int(state.get("epoch", 0)), int(state.get("row", 0))

    def take(self, n: int) -> dict[str, np.ndarray]:
        """The next `n` rows of this epoch (fewer at its end; the next call starts the next epoch)."""
        if self.row >= self.num_rows:
            self.epoch, self.row = self.epoch + 1, 0
        order = np.arange(self.num_rows)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
        picked = order[self.row : self.row + n]
        self.row += len(picked)
        return {name: arr[picked] for name, arr in self.rows.items()}


def sft_loss(out: PolicyOutput, mb: MicroBatch) -> LossOutput:
    """Negative log-likelihood summed over assistant tokens (the trainer divides by their count)."""
    return LossOutput(loss_sum=-(out.logprobs * mb["loss_mask"]).sum())


def train(cfg: SFTConfig) -> None:
    parts = TrainerParts.of(cfg)
    trainer = Trainer(parts, source="sft")
    try:
        tokenizer = trainer.tokenizer
        samples = conversation_samples(tokenizer, load_conversations(cfg.data, cfg.train.seed))
        data = PackedEpochs(samples, cfg.data.seq_len, cfg.data.shuffle, cfg.train.seed, tokenizer.pad_token_id or 0)
        max_steps = cfg.train.max_steps or -(-data.num_rows // cfg.data.rows_per_step)
        log.info(
            "%d conversations -> %d rows of %d tokens; %d steps of %d rows",
            len(samples),
            data.num_rows,
            cfg.data.seq_len,
            max_steps,
            cfg.data.rows_per_step,
        )
        step, data_state = trainer.resume()
        data.restore(data_state)
        while step < max_steps:
            rows = data.take(cfg.data.rows_per_step)
            mine = split_rows(rows, trainer.dist.world_size, tokenizer.pad_token_id or 0)[trainer.dist.rank]
            metrics = trainer.step(micro_batches(mine, cfg.train.micro_batch_rows, trainer.device), sft_loss)
            metrics["epoch"] = data.epoch
            step += 1
            trainer.finish_step(step, metrics, data.state(), is_last=step >= max_steps)
    finally:
        trainer.close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_argv(SFTConfig, argv, prog="primerl sft")
    setup_logging(int(os.environ.get("RANK", "0")), "sft")
    if not wants_cuda(cfg.train.device):  # a GPU trainer's large blocks are the device's
        keep_freed_memory()
    train(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
