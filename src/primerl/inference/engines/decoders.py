"""Decoders: the model side of the engine, which turns token ids into next-token logits for a batch of rows.

A decoder holds `max_rows` rows. Rows in use are always 0..n-1 (the engine keeps them compact with `move_row`).
`prefill` starts rows from their prompts; `decode` feeds one token to each of rows 0..n-1 at its position and returns
the logits that follow it. `ReferenceDecoder` recomputes the whole sequence with the Hugging Face forward at every
step: it is the naive reference for the fast decoders and the fallback for architectures without one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from transformers import PreTrainedModel


class Decoder(ABC):
    """Next-token logits for up to `max_rows` sequences; see the module docstring."""

    max_rows: int

    @abstractmethod
    def prefill(self, first_row: int, prompts: list[list[int]]) -> torch.Tensor:
        """Start rows first_row.. with `prompts`; returns float32 logits [len(prompts), V] after each prompt."""

    @abstractmethod
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Feed `tokens[i]` at `positions[i]` to row i for i < len(tokens); returns float32 logits [n, V]."""

    @abstractmethod
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Make row `dst` continue the sequence of row `src`, whose first `length` positions are filled (row `src`
        is then unused)."""

    def weights_changed(self) -> None:
        """Called after the model's parameters were overwritten in place."""

    def warm_up(self) -> None:
        """Do the one-time work of the first decode step (compiling it) now, before the engine serves."""

    def decode_many(
        self,
        tokens: list[int] | None,
        positions: list[int],
        temperature: torch.Tensor | None,
        uniforms: torch.Tensor,
        follow: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`len(uniforms)` decode steps in a row for rows 0..n-1 without returning to the host: each step samples
        every row's next token over the whole vocabulary (`sampling.sample_unfiltered`, row i's temperature and
        `uniforms[step, i]`) and feeds it to the next step. Returns (tokens, logprobs), each [steps, n], on the
        device, possibly still being computed, or None when the decoder cannot (the caller then decodes one step at
        a time). `follow`: the rows are the previous call's, unmoved, and continue where it left them on the device
        (its last sampled tokens, at its temperatures); `tokens` and `temperature` are then not read, and
        `positions` are those the rows will have when the previous call is done, so the caller need not wait for
        it."""
        return None


class ReferenceDecoder(Decoder):
    """Full forward of every row's sequence at every step, right-padded, without a KV cache."""

    def __init__(self, model: PreTrainedModel, max_rows: int):
        self.model = model
        self.max_rows = max_rows
        self.sequences: list[list[int]] = [[] for _ in range(max_rows)]

    @torch.inference_mode()
    def _last_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        device = self.model.device
        lengths = torch.tensor([len(s) for s in sequences], device=device)
        width = int(lengths.max())
        input_ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
        for i, s in enumerate(sequences):
            input_ids[i, : len(s)] = torch.tensor(s, device=device)
        attention_mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask.long(), use_cache=False).logits
        return logits[torch.arange(len(sequences), device=device), lengths - 1].float()

    def prefill(self, first_row: int, prompts: list[list[int]]) -> torch.Tensor:
        for i, prompt in enumerate(prompts):
            self.sequences[first_row + i] = list(prompt)
        return self._last_logits(prompts)

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        for row, (token, position) in enumerate(zip(tokens, positions, strict=True)):
            sequence = self.sequences[row]
            del sequence[position:]
            sequence.append(token)
        return self._last_logits(self.sequences[: len(tokens)])

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.sequences[dst], self.sequences[src] = self.sequences[src], []
