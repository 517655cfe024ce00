"""The embedded engine: continuous batching over a transformers model, on CPU or one GPU.

Contract: works on token ids (see `base`); a scheduler thread owns the model and runs one step at a time — admit
waiting requests (one batched prefill, each samples its first token), then one decode forward for every running
row; a request that arrives mid-decode joins at the next step. Weight updates, pauses and aborts are applied between
steps. Events cross to the asyncio loop once per step.

The scheduler is a thread rather than an asyncio task so that torch work, which releases the GIL, never stalls the
server's event loop: HTTP parsing, streaming and admin routes stay responsive while a step runs.

This module holds the engine's lifecycle, its request streams and the scheduler thread's loop; the row work (admit,
decode, record, retire) is in `hf_rows`, the weight intake (files, shared buffers, the broadcast receiver) in
`hf_weights`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import torch

from primerl.cpu import keeps_freed_memory, trim_freed_memory
from primerl.inference.engines.base import Engine, Event, Finish, SamplingParams, check_prompt
from primerl.inference.engines.decoders import Decoder, ReferenceDecoder
from primerl.inference.engines.hf_rows import Chunk, Request, Rows
from primerl.inference.engines.hf_weights import WeightIntake

log = logging.getLogger("primerl.inference")

DecoderKind = Literal["auto", "fast", "reference"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SERVER_TRIM_ABOVE_BYTES = 2**24  # the server's free heap, after a weight version, above which it is handed back ...
SERVER_TRIM_GROWTH_BYTES: int | None = None  # ... after every version: no growth step (benchmarks/NOTES.md, soak)


class HFEngine(WeightIntake, Rows, Engine):
    """Continuous-batching engine over a Hugging Face causal LM.

    `model` is a local model directory or a name `primerl.models.resolve_model` knows. `device`/`dtype` "auto" pick
    CUDA + bfloat16 when a GPU is present, else CPU + float32. `max_batch_size` rows decode together; more requests
    wait. `decoder` "fast" uses the static-KV-cache decoder (Llama/Qwen families), "reference" the uncached HF
    forward, "auto" the fast one where supported. `cuda_graphs` (default: on for CUDA) captures decode steps;
    `compile` (default: on for CUDA) compiles the fast decoder's decode layer at start.
    `decode_steps` decode steps run back to back on the device (sampling included, no host synchronisation between
    them) before the scheduler looks at the tokens: rows that finish inside such a chunk decode a few tokens past
    their end, which are dropped; new requests, aborts and weight updates wait for the chunk to end. `overlap`
    (default: on for CUDA) launches the next chunk for the same rows before the host reads the last one's tokens
    when no request waits for a row, so the device decodes while the host records tokens, checks stops and
    schedules; when a row of the chunk read has finished, the next one is read at once too and the rows are then
    retired, and the next launch waits for it (rows change only between chunks). `seed` seeds the seeds drawn for
    requests that bring none (None: a fresh stream).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        model_name: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 8192,
        decoder: DecoderKind = "auto",
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        decode_steps: int = 8,
        overlap: bool | None = None,
        threads: int | None = None,
        seed: int | None = None,
    ):
        if threads is not None:
            torch.set_num_threads(threads)  # the process's intra-op pool, which the scheduler thread's steps use
        self.model_source = model
        self.model_name = model_name or str(model)
        self.device = torch.device(
            "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
        )
        if dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = _DTYPES[dtype]
        self.max_batch_size = max_batch_size
        self.requested_max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.decoder_kind = decoder
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.compile = self.device.type == "cuda" if compile is None else compile
        self.decode_steps = decode_steps
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.policy_version = 0
        self._seeds = random.Random(seed)
        self._shared_reader: Any = None  # primerl.transport.shared.SharedReader, made at the first shared version
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._in_flight: set[str] = set()
        self._error: BaseException | None = None
        # scheduler-thread state
        self._waiting: deque[Request] = deque()
        self._rows: list[Request] = []
        self._ahead: Chunk | None = None  # launched, not yet read (with `overlap`)
        self.chunks_ahead = 0  # chunks launched while the one before was still in flight (with `overlap`)
        self._outbox: list[tuple[asyncio.Queue[list[Event]], Event]] = []
        self._paused = False
        self._stopping = False
        # weight receiver thread
        self._receiver_thread: threading.Thread | None = None
        self._receiver_stop = threading.Event()

    # ----------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="primerl-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(self.model_source)
        if not path.is_dir():
            from primerl.models import resolve_model

            path = resolve_model(str(self.model_source))
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.vocab_size = self.model.config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        model_limit = self.model.config.max_position_embeddings
        self.max_model_len = min(self.requested_max_model_len or model_limit, model_limit)
        self.decoder = self._build_decoder()
        if getattr(self.decoder, "compiled", False):
            log.info("compiling the decode step (tens of seconds the first time; torch's compile cache keeps it)")
            started = time.monotonic()
            try:
                self.decoder.warm_up()
                log.info("decode step compiled in %.1f s", time.monotonic() - started)
            except Exception as error:  # noqa: BLE001 -- no working compiler here (triton, a C compiler): decode uncompiled
                log.warning("compiling the decode step failed (%s: %s); decoding uncompiled (inference.compile = false "
                            "skips the attempt)", type(error).__name__, (str(error).splitlines() or [""])[0][:300])
                self.compile = False
                self.decoder = self._build_decoder()
        if self.device.type == "cpu" and keeps_freed_memory():
            self._prefault_weight_intake()

    @torch.no_grad()
    def _prefault_weight_intake(self) -> None:
        """Do the first weight update's one-time memory work at load, where nothing waits for it: write every
        parameter once (loaded weights can be copy-on-write pages of the model file, which the first in-place copy
        otherwise faults in one by one) and pack the weights a second time, freeing the first packing into this
        process's heap for the first new version's re-pack (benchmarks/NOTES.md, "Where the first 30 s of a CPU run
        go")."""
        for param in self.model.parameters():
            param.mul_(1.0)
        self.decoder.weights_changed()

    def _build_decoder(self) -> Decoder:
        if self.decoder_kind == "reference":
            return ReferenceDecoder(self.model, self.max_batch_size)
        from primerl.inference.engines.llama import LlamaDecoder

        if LlamaDecoder.supports(self.model):
            return LlamaDecoder(
                self.model, self.max_batch_size, self.max_model_len, cuda_graphs=self.cuda_graphs, compile=self.compile
            )
        if self.decoder_kind == "fast":
            raise ValueError(f"no fast decoder for model type {self.model.config.model_type!r}; use 'reference'")
        return ReferenceDecoder(self.model, self.max_batch_size)

    async def stop(self) -> None:
        self._receiver_stop.set()
        if self._thread is None:
            return
        self._inbox.put(("stop",))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # ------------------------------------------------------------------------------------------------ requests

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[Event]:
        if not self.healthy():
            raise RuntimeError(f"engine is not running{f': {self._error!r}' if self._error else ''}")
        check_prompt(prompt_ids, self.max_model_len)
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        request = Request(
            request_id=request_id,
            prompt=list(prompt_ids),
            params=params,
            stream=asyncio.Queue(),
            rng=random.Random(params.seed if params.seed is not None else self._seeds.getrandbits(63)),
            stop_ids=frozenset(stop_ids),
            stop_window=max((len(s.encode()) for s in params.stop), default=0) + 2,
        )
        return self._stream(request)

    async def _stream(self, request: Request) -> AsyncIterator[Event]:
        self._in_flight.add(request.request_id)
        self._inbox.put(("submit", request))
        finished = False
        try:
            while not finished:
                for event in await request.stream.get():
                    finished = isinstance(event, Finish)
                    yield event
        finally:
            self._in_flight.discard(request.request_id)
            if not finished:
                self._inbox.put(("abort", request.request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        if len(token_ids) < 2:
            return []
        return await self._call_scheduler("score", list(token_ids))

    async def pause(self) -> None:
        await self._call_scheduler("pause")

    async def resume(self) -> None:
        await self._call_scheduler("resume")

    async def _call_scheduler(self, command: str, *args: Any) -> Any:
        if not self.healthy():
            raise RuntimeError("engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._inbox.put((command, *args, done))
        return await done

    # ------------------------------------------------------------------------------------------ scheduler thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self._handle_inbox(block=self._paused or not (self._rows or self._waiting))
                    if self._stopping or self._paused:
                        continue
                    self._admit()
                    if self._rows:
                        self._decode_step()
                    self._flush()
        except BaseException as error:  # the engine is dead: tell every waiting consumer
            self._error = error
            raise
        finally:
            self._ahead = None
            for request in [*self._rows, *self._waiting]:
                self._finish(request, "abort")
            self._rows.clear()
            self._waiting.clear()
            self._flush()

    def _handle_inbox(self, block: bool) -> None:
        messages = [self._inbox.get()] if block else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for command, *args in messages:
            if command != "submit":  # the rows or the weights change: read the chunk in flight first
                self._catch_up()
            if command == "submit":
                self._waiting.append(args[0])
            elif command == "abort":
                self._abort(args[0])
            elif command == "weights":
                tensors, step, done = args
                self._apply_weights(tensors, step, done)
            elif command == "score":
                token_ids, done = args
                self._score(token_ids, done)
            elif command == "pause":
                self._paused = True
                self._resolve(args[0])
            elif command == "resume":
                self._paused = False
                self._resolve(args[0])
            elif command == "stop":
                self._stopping = True

    def _resolve(self, future: asyncio.Future[Any], error: BaseException | None = None, result: Any = None) -> None:
        def settle() -> None:
            if not future.done():
                future.set_exception(error) if error else future.set_result(result)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(settle)

    def _apply_weights(self, tensors: dict[str, torch.Tensor], step: int, done: asyncio.Future[None]) -> None:
        params = dict(self.model.named_parameters())
        try:
            for name, tensor in tensors.items():
                params[name].copy_(tensor)
            self.decoder.weights_changed()
            if self.device.type == "cuda":  # done reading the source (a shared buffer may be overwritten next)
                torch.cuda.synchronize(self.device)
        except BaseException as error:
            self._resolve(done, error)
            raise
        # A kept heap (CPU) grows now and then when a block fits none of its holes, and the pages a trim handed
        # back are faulted in again a few at a time by the blocks that land there: hand the free pages back after
        # every version, so the process follows its bytes in use (benchmarks/NOTES.md, "The long-run soak": ~6 ms
        # and the re-faults of the pages the next batch reuses, ~1 % of a demo step; the update's answer waits)
        trim_freed_memory(SERVER_TRIM_ABOVE_BYTES, SERVER_TRIM_GROWTH_BYTES)
        self.policy_version = step
        self._resolve(done)

    def _score(self, token_ids: list[int], done: asyncio.Future[list[float]]) -> None:
        """The log-prob of each token after the first under the untempered softmax of the live weights (one full
        forward of the sequence; the request fails alone if it does)."""
        try:
            ids = torch.tensor([token_ids], device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            self._resolve(done, result=logprobs.double().cpu().tolist())
        except Exception as error:  # noqa: BLE001 -- handed to the caller; the engine keeps serving
            self._resolve(done, error)

    def _abort(self, request_id: str) -> None:
        for index, request in enumerate(self._rows):
            if request.request_id == request_id:
                self._finish(request, "abort")
                self._remove_rows([index])
                return
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                self._finish(request, "abort")
                return

    def _flush(self) -> None:
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        grouped: dict[asyncio.Queue[list[Event]], list[Event]] = {}
        for stream, event in outbox:  # one queue item per request per flush (a chunk's tokens), not one per token
            grouped.setdefault(stream, []).append(event)

        def deliver() -> None:
            for stream, events in grouped.items():
                stream.put_nowait(events)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(deliver)


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
