"""The embedded engine's rows (`HFEngine`): admitting waiting requests into free rows (one batched prefill), decoding
every row one step or a chunk of steps at a time, recording sampled tokens, finishing requests and retiring their rows.

With `decode_steps` > 1 a chunk of steps runs on the device with no host synchronisation; with `overlap` the next
chunk for the same rows is launched before the host reads the last one's tokens (see `HFEngine`).
"""

from __future__ import annotations

import asyncio
import queue
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from primerl.inference.engines.base import Event, Finish, FinishReason, SamplingParams, TokenEvent
from primerl.inference.engines.decoders import Decoder
from primerl.inference.engines.sampling import SamplingBatch, sample


@dataclass(eq=False)
class Request:
    """A request as the scheduler sees it: inputs, its output stream, and what it has produced so far."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: asyncio.Queue[list[Event]]  # the engine thread hands over each flush's events of this request at once
    rng: random.Random
    stop_ids: frozenset[int]
    stop_window: int  # trailing tokens to decode when looking for stop strings
    completion: list[int] = field(default_factory=list)
    versions: tuple[int, int] | None = None
    done: bool = False  # finished: tokens of a chunk already in flight are dropped

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)


@dataclass
class Chunk:
    """Decode steps launched for `requests` (rows 0..n-1 at launch) whose tokens the host has not yet read: `host`
    [2, steps, n] (tokens and logprobs) is complete once `ready` has passed (None: already complete)."""

    requests: list[Request]
    steps: int
    host: torch.Tensor
    ready: torch.cuda.Event | None


class Rows:
    """The row work of `HFEngine`'s scheduler thread. The engine provides the model, tokenizer, decoder, limits and
    the queues named below."""

    model: Any
    tokenizer: Any
    decoder: Decoder
    max_model_len: int
    max_prefill_tokens: int
    decode_steps: int
    overlap: bool
    policy_version: int
    chunks_ahead: int
    _inbox: queue.SimpleQueue[tuple[Any, ...]]
    _waiting: deque[Request]
    _rows: list[Request]
    _ahead: Chunk | None
    _outbox: list[tuple[asyncio.Queue[list[Event]], Event]]

    def _admit(self) -> None:
        """Prefill as many waiting requests as there are free rows (within the prefill token budget)."""
        if self._waiting and self._ahead is not None and len(self._rows) < self.decoder.max_rows:
            self._catch_up()
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        while self._waiting and len(self._rows) + len(admitted) < self.decoder.max_rows:
            if admitted and len(self._waiting[0].prompt) > budget:
                break
            request = self._waiting.popleft()
            budget -= len(request.prompt)
            admitted.append(request)
        if not admitted:
            return
        first_row = len(self._rows)
        self._rows.extend(admitted)
        logits = self.decoder.prefill(first_row, [r.prompt for r in admitted])
        self._sample_rows(logits, first_row)

    def _decode_step(self) -> None:
        if self._ahead is not None:
            self._step_ahead()
            return
        steps = self._chunk_steps()
        if steps > 1:
            chunk = self._launch(steps, follow=False)
            if self.overlap:
                self._ahead = chunk  # read after the next chunk is launched
            else:
                self._remove_rows(self._read(chunk))
            return
        tokens = [r.completion[-1] for r in self._rows]
        positions = [r.length - 1 for r in self._rows]
        logits = self.decoder.decode(tokens, positions)
        self._sample_rows(logits, 0)

    def _step_ahead(self) -> None:
        """With a chunk in flight: launch the next one for the same rows where nothing waits for the rows to change,
        then read the one in flight; retire the rows that finished (reading the new chunk first, if any).

        Nothing may wait: with requests waiting (even for a full batch) a row that finishes in the chunk read would
        stay empty through the chunk launched ahead, so the engine then reads each chunk before the next, as without
        `overlap`, and refills freed rows at once."""
        previous, self._ahead = self._ahead, None
        assert previous is not None
        if not self._waiting and self._inbox.empty():
            steps = self._chunk_steps(ahead=previous.steps)
            if steps > 0:
                self._ahead = self._launch(steps, follow=True, ahead=previous.steps)
                self.chunks_ahead += 1
        finished = self._read(previous)
        if finished and self._ahead is not None:
            current, self._ahead = self._ahead, None
            finished += self._read(current)  # rows finished in `previous` are skipped there: no index twice
        self._remove_rows(finished)

    def _catch_up(self) -> None:
        """Read the chunk in flight, if any, and retire its finished rows: the rows are then the host's to change."""
        if self._ahead is not None:
            chunk, self._ahead = self._ahead, None
            self._remove_rows(self._read(chunk))

    def _launch(self, steps: int, follow: bool, ahead: int = 0) -> Chunk:
        """Launch `steps` decode steps of every row (`follow`: continuing a chunk still in flight, `ahead` steps
        beyond the rows' recorded tokens) and the copy of their tokens to the host, without waiting for either."""
        requests = list(self._rows)
        positions = [r.length - 1 + ahead for r in requests]
        uniforms = torch.tensor([[1.0 - r.rng.random() for r in requests] for _ in range(steps)], dtype=torch.float64)
        if follow:
            tokens, temperature = None, None
        else:
            tokens = [r.completion[-1] for r in requests]
            temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
        sampled = self.decoder.decode_many(tokens, positions, temperature, uniforms, follow=follow)
        if sampled is None:
            raise RuntimeError(f"{type(self.decoder).__name__} cannot decode several steps at once")
        stacked = torch.stack((sampled[0].double(), sampled[1].double()))
        if stacked.device.type != "cuda":
            return Chunk(requests, steps, stacked.cpu(), None)
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)  # one device-to-host copy per chunk
        ready = torch.cuda.Event()
        ready.record()
        return Chunk(requests, steps, host, ready)

    def _chunk_steps(self, ahead: int = 0) -> int:
        """How many decode steps to run before returning to the host: `decode_steps`, fewer when no row needs that
        many more tokens or the longest row would pass max_model_len, and 1 when a row filters its vocabulary
        (top-p / top-k: sampled by the general path) or the decoder cannot chain steps. With `ahead` steps already
        in flight: the steps to launch after them, 0 when no row needs more (or none may be launched)."""
        if self.decode_steps <= 1 or type(self.decoder).decode_many is Decoder.decode_many:
            return 0 if ahead else 1
        vocab = self.model.config.vocab_size
        if any(r.params.top_p < 1 or 0 < r.params.top_k < vocab for r in self._rows):
            return 0 if ahead else 1
        wanted = max(r.params.max_tokens - len(r.completion) for r in self._rows) - ahead
        room = self.max_model_len - max(r.length for r in self._rows) - ahead
        steps = min(self.decode_steps, wanted, room)
        return max(0, steps) if ahead else max(1, steps)

    def _read(self, chunk: Chunk) -> list[int]:
        """Record each row's tokens of a chunk in order, up to where the row finished (later tokens of a finished
        row were decoded past its end and are dropped; so are all of a row that finished before). Returns the rows
        (indices at launch) that finished in this chunk."""
        if chunk.ready is not None:
            chunk.ready.synchronize()
        token_rows, logprob_rows = chunk.host[0].long().T.tolist(), chunk.host[1].T.tolist()
        finished = []
        for index, request in enumerate(chunk.requests):
            if request.done:
                continue
            for token, logprob in zip(token_rows[index], logprob_rows[index], strict=True):
                if self._accept(request, token, logprob):
                    finished.append(index)
                    break
        return finished

    def _sample_rows(self, logits: torch.Tensor, first_row: int) -> None:
        """Sample the next token of rows first_row.. from `logits`, emit them, retire finished rows."""
        requests = self._rows[first_row:]
        batch = SamplingBatch.build(
            [r.params for r in requests],
            [1.0 - r.rng.random() for r in requests],
            vocab=logits.shape[-1],
            device=logits.device,
        )
        token_ids, logprobs = sample(logits, batch)
        on_host = torch.stack((token_ids.double(), logprobs.double())).cpu()  # one device-to-host copy
        token_ids, logprobs = [int(t) for t in on_host[0].tolist()], on_host[1].tolist()
        finished = []
        for offset, (request, token, logprob) in enumerate(zip(requests, token_ids, logprobs, strict=True)):
            if self._accept(request, token, logprob):
                finished.append(first_row + offset)
        self._remove_rows(finished)

    def _accept(self, request: Request, token: int, logprob: float) -> bool:
        """Record a sampled token; returns True when the request is finished."""
        version = self.policy_version
        request.completion.append(token)
        request.versions = (request.versions[0] if request.versions else version, version)
        self._outbox.append((request.stream, TokenEvent(token, logprob, version)))
        params = request.params
        if token in request.stop_ids:
            self._finish(request, "stop", token)
        elif params.stop and (matched := self._matched_stop_string(request)) is not None:
            self._finish(request, "stop", matched)
        elif len(request.completion) >= params.max_tokens or request.length >= self.max_model_len:
            self._finish(request, "length")
        else:
            return False
        return True

    def _matched_stop_string(self, request: Request) -> str | None:
        tail = self.tokenizer.decode(request.completion[-request.stop_window :], skip_special_tokens=False)
        return next((s for s in request.params.stop if s in tail), None)

    def _finish(self, request: Request, reason: FinishReason, stop: str | int | None = None) -> None:
        request.done = True
        versions = request.versions or (self.policy_version, self.policy_version)
        finish = Finish(reason, versions, len(request.prompt), len(request.completion), stop)
        self._outbox.append((request.stream, finish))

    def _remove_rows(self, indices: list[int]) -> None:
        """Drop finished rows, keeping rows 0..n-1 in use: the last row moves into each hole."""
        for index in sorted(indices, reverse=True):
            last = len(self._rows) - 1
            if index != last:
                self.decoder.move_row(last, index, self._rows[last].length)
                self._rows[index] = self._rows[last]
            self._rows.pop()

