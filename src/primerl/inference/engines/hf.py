"""The embedded engine: continuous batching over a transformers model, on CPU or one GPU.

Contract: works on token ids (see `base`); a scheduler thread owns the model and runs one step at a time — admit
waiting requests (one batched prefill, each samples its first token), then one decode forward for every running
row; a request that arrives mid-decode joins at the next step. Weight updates, pauses and aborts are applied between
steps. Events cross to the asyncio loop once per step.

The scheduler is a thread rather than an asyncio task so that torch work, which releases the GIL, never stalls the
server's event loop: HTTP parsing, streaming and admin routes stay responsive while a step runs.

New weights arrive as named tensors — read from a safetensors directory (`update_weights`) or received from the
trainer's weight group by a receiver thread (`start_weight_receiver`) — and take one path, `load_named_tensors`: every
name and shape is checked against the model first (nothing changes on a mismatch), then the scheduler copies them
into the parameters between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from primerl.cpu import keeps_freed_memory
from primerl.inference.engines.base import Engine, Event, Finish, FinishReason, SamplingParams, TokenEvent
from primerl.inference.engines.decoders import Decoder, ReferenceDecoder
from primerl.inference.engines.sampling import SamplingBatch, sample

if TYPE_CHECKING:
    from primerl.config.inference import BroadcastReceiverSection
    from primerl.transport.broadcast import BroadcastReceiver, Transfer

log = logging.getLogger("primerl.inference")

DecoderKind = Literal["auto", "fast", "reference"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(eq=False)
class _Request:
    """A request as the scheduler sees it: inputs, its output stream, and what it has produced so far."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: asyncio.Queue[Event]
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
class _Chunk:
    """Decode steps launched for `requests` (rows 0..n-1 at launch) whose tokens the host has not yet read: `host`
    [2, steps, n] (tokens and logprobs) is complete once `ready` has passed (None: already complete)."""

    requests: list[_Request]
    steps: int
    host: torch.Tensor
    ready: torch.cuda.Event | None


class HFEngine(Engine):
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
        self._waiting: deque[_Request] = deque()
        self._rows: list[_Request] = []
        self._ahead: _Chunk | None = None  # launched, not yet read (with `overlap`)
        self.chunks_ahead = 0  # chunks launched while the one before was still in flight (with `overlap`)
        self._outbox: list[tuple[asyncio.Queue[Event], Event]] = []
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
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len {self.max_model_len} leaves no "
                "room for a completion"
            )
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        request = _Request(
            request_id=request_id,
            prompt=list(prompt_ids),
            params=params,
            stream=asyncio.Queue(),
            rng=random.Random(params.seed if params.seed is not None else self._seeds.getrandbits(63)),
            stop_ids=frozenset(stop_ids),
            stop_window=max((len(s.encode()) for s in params.stop), default=0) + 2,
        )
        return self._stream(request)

    async def _stream(self, request: _Request) -> AsyncIterator[Event]:
        self._in_flight.add(request.request_id)
        self._inbox.put(("submit", request))
        finished = False
        try:
            while not finished:
                event = await request.stream.get()
                finished = isinstance(event, Finish)
                yield event
        finally:
            self._in_flight.discard(request.request_id)
            if not finished:
                self._inbox.put(("abort", request.request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # ------------------------------------------------------------------------------------------- admin routes

    async def update_weights(self, path: str | Path, step: int) -> None:
        tensors = await asyncio.to_thread(_read_safetensors, Path(path))
        await self.load_named_tensors(tensors, step, source=str(path))

    async def load_shared_weights(self, snapshot: Path, run_dir: Path, step: int) -> None:
        from primerl.transport.shared import SharedReader

        if self._shared_reader is None:
            self._shared_reader = SharedReader(self.device)
        tensors = self._shared_reader.tensors(snapshot, run_dir)
        await self.load_named_tensors(tensors, step, source=f"shared weights of {snapshot}")

    async def load_named_tensors(self, tensors: Mapping[str, torch.Tensor], step: int, source: str) -> None:
        """Copy `tensors` (transformers names; a tied alias names its parameter) into the model between two decode
        steps and set `policy_version = step`. Every name and shape is checked first: on a mismatch ValueError, and
        the old weights keep serving. `source` names where the tensors came from, for messages."""
        targets = self.check_weights({name: tuple(t.shape) for name, t in tensors.items()}, source)
        await self._call_scheduler("weights", {targets[name]: t for name, t in tensors.items()}, step)

    def check_weights(self, shapes: Mapping[str, Sequence[int]], source: str) -> dict[str, str]:
        """Check named shapes against the model: every parameter present (a tied alias is enough), no unknown name,
        shapes equal. Returns each name's parameter name."""
        aliases = dict(self.model.named_parameters(remove_duplicate=False))
        params = dict(self.model.named_parameters())
        canonical = {id(p): name for name, p in params.items()}
        targets: dict[str, str] = {}
        for name, shape in shapes.items():
            if name not in aliases:
                raise ValueError(f"{source}: unknown tensor {name!r}")
            target = canonical[id(aliases[name])]
            if tuple(shape) != tuple(params[target].shape):
                raise ValueError(
                    f"{source}: {name} has shape {tuple(shape)}, model expects {tuple(params[target].shape)}"
                )
            targets[name] = target
        missing = sorted(set(params) - set(targets.values()))
        if missing:
            raise ValueError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return targets

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

    # ---------------------------------------------------------------------------------------- weight broadcast

    async def start_weight_receiver(self, settings: BroadcastReceiverSection) -> None:
        if not self.healthy():
            raise RuntimeError("engine is not running")
        if self._receiver_thread is not None:
            raise RuntimeError("the weight receiver is already running")
        from primerl.transport.broadcast import BroadcastReceiver

        receiver = BroadcastReceiver(settings.host, settings.port, device=self.device,
                                     init_timeout_s=settings.init_timeout_s, timeout_s=settings.timeout_s)
        self.receiver_state = f"joining the weight group at {settings.host}:{settings.port}"
        self._receiver_thread = threading.Thread(
            target=self._follow_broadcasts, args=(receiver, settings.timeout_s), name="primerl-weights", daemon=True
        )
        self._receiver_thread.start()

    def _follow_broadcasts(self, receiver: BroadcastReceiver, timeout_s: float) -> None:
        """Receiver thread: join the group, then receive and apply every transfer until the group closes."""
        from primerl.transport.broadcast import GroupClosed, GroupFormationError

        try:
            rank = receiver.join()
        except GroupFormationError as e:
            self.receiver_state = f"failed: {e}"
            log.warning("weight broadcast: not joined, only filesystem snapshots can be loaded: %s", e)
            return
        self.receiver_state = f"rank {rank} of {receiver.world_size} ({receiver.backend})"
        try:
            while not self._receiver_stop.is_set():
                transfer = receiver.next_transfer(timeout_s=0.5)
                if transfer is not None:
                    self._receive(receiver, transfer, timeout_s)
        except GroupClosed as e:
            self.receiver_state = f"closed: {e}"
            log.info("weight broadcast: the group is closed (%s)", e)
        except Exception as e:  # the receiver is done; the server serves on
            self.receiver_state = f"failed: {e}"
            log.exception("weight broadcast: the receiver stopped")
        finally:
            receiver.close()

    def _receive(self, receiver: BroadcastReceiver, transfer: Transfer, timeout_s: float) -> None:
        source = f"weights step {transfer.step} (broadcast {transfer.transfer_id})"
        started = time.perf_counter()
        try:
            tensors = dict(receiver.receive(transfer, check=lambda m: self.check_weights(m.shapes(), source)))
            received = time.perf_counter()
            assert self._loop is not None
            applying = asyncio.run_coroutine_threadsafe(
                self.load_named_tensors(tensors, transfer.step, source), self._loop
            )
            applying.result(timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - reported to the sender, which falls back to the filesystem
            log.warning("weight broadcast not applied: %s", e)
            receiver.finish(transfer, error=str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        receiver.finish(transfer)
        manifest = transfer.manifest
        log.info(
            "weights: received step %d by broadcast: %d tensors, %.1f MB in %d bucket(s); receive %.2fs, apply %.2fs",
            transfer.step, manifest.num_tensors, manifest.num_bytes / 1e6, len(manifest.buckets),
            received - started, time.perf_counter() - received,
        )

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

    def _admit(self) -> None:
        """Prefill as many waiting requests as there are free rows (within the prefill token budget)."""
        if self._waiting and self._ahead is not None and len(self._rows) < self.decoder.max_rows:
            self._catch_up()
        admitted: list[_Request] = []
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

    def _launch(self, steps: int, follow: bool, ahead: int = 0) -> _Chunk:
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
            return _Chunk(requests, steps, stacked.cpu(), None)
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)  # one device-to-host copy per chunk
        ready = torch.cuda.Event()
        ready.record()
        return _Chunk(requests, steps, host, ready)

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

    def _read(self, chunk: _Chunk) -> list[int]:
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

    def _accept(self, request: _Request, token: int, logprob: float) -> bool:
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

    def _matched_stop_string(self, request: _Request) -> str | None:
        tail = self.tokenizer.decode(request.completion[-request.stop_window :], skip_special_tokens=False)
        return next((s for s in request.params.stop if s in tail), None)

    def _finish(self, request: _Request, reason: FinishReason, stop: str | int | None = None) -> None:
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

    def _flush(self) -> None:
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []

        def deliver() -> None:
            for stream, event in outbox:
                stream.put_nowait(event)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(deliver)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of the `*.safetensors` files of a directory."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
