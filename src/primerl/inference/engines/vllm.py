"""The vLLM engine: the `Engine` contract (see `base`) over vLLM's `AsyncLLM` (V1 engine, vLLM 0.19 to 0.32), for GPUs.

vllm is a GPU-only extra (`pip install 'primerl[gpu]'`). On the CPU, tests/inference/test_vllm_binding.py drives
this module against the installed vLLM's classes (every call bound to the real signatures, the real engine arguments,
sampling parameters and outputs); the GPU tests (tests/gpu/test_vllm_engine.py) and benchmarks/vllm_h200.py run it
on a GPU machine. What differs between the vLLM versions lives in `vllm_compat`, which also refuses a version outside
the range: before 0.26 the engine runs without async scheduling and refuses sleep mode (why: `vllm_compat`). vllm
is imported only when this engine starts; without it, or with a vLLM or an option `vllm_compat` refuses,
`VLLMEngine(...)` raises `EngineUnavailable`, which `primerl inference --engine vllm` reports in one line (exit 2).

How the contract maps onto vLLM:
- logprobs: the engine runs with `logprobs_mode="processed_logprobs"`, so the logprob of a sampled token is taken
  from the distribution it was sampled from (after temperature, top-k, top-p), as `base` requires. A sampled token
  that comes back without its logprob fails the request (RuntimeError), never a made-up 0.0.
- seeds: a request without a seed passes none, so vLLM keeps its batched sampling path (a per-request seed moves the
  whole batch onto per-request generators); the engine-wide `seed` seeds vLLM's global generator.
- weight updates (a snapshot directory, the trainer's shared buffer, or a broadcast): pause with mode "keep"
  (requests in flight stay queued with their KV blocks), load the tensors on every worker through `vllm_worker.WorkerExtension`
  (the model's own `load_weights` maps checkpoint names onto vLLM's fused parameters), then reset the prefix cache
  with `reset_running_requests=True`: vLLM preempts the requests in flight (they recompute their KV under the new
  weights when they resume) so that no cached block computed by the old weights is reused; a reset vLLM reports as
  failed fails the update. Then the policy version moves and generation resumes.
- output batching: vLLM runs with `stream_interval = vllm.stream_interval`, so its output handler (in this
  process, on the server's event loop) hands each request its tokens every N decode steps instead of after every
  step; at batch 256 the per-step wake-ups of every request's stream were what held the adapter below vLLM's own
  offline rate (benchmarks/NOTES.md).
- policy versions: each request keeps the runs of its tokens by version, as (first token index, version). A weight
  update, once the pause has completed, reads how many tokens each request in flight has sampled: every output the
  engine sent before its pause completed is already queued for vLLM's output handler (one socket, in order), so a
  marker queued behind them and consumed by the handler means all of them were processed. The new version starts
  at that count, whether those tokens had been handed to the stream yet or not (with a stream interval, up to N - 1
  of them are held back).
- sleep mode (`vllm.sleep_level = 1`, for a trainer on the same GPU; vLLM 0.26 and newer): `pause` puts vLLM to
  sleep (weights offloaded to CPU memory, KV cache freed), `resume` wakes it; a weight update while asleep wakes the
  weights alone first (generation stays paused until the KV cache wakes at `resume`).
- weight broadcast (`start_weight_receiver`, docs/weights.md): every worker is one receiver rank of the trainer's
  weight group (`primerl_broadcast_join`, joining in a background thread of the worker). This process follows the
  trainer's announcements through the store (`TransferFeed`); for each it applies the transfer as above with every
  worker receiving the buckets straight into its model (`primerl_broadcast_receive`), confirms to the trainer for
  all its ranks and resumes. A worker that fails mid-transfer leaves the model partly updated; the trainer then
  falls back to writing that version in full, which the orchestrator loads over it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from primerl.inference.engines import vllm_compat
from primerl.inference.engines.base import Engine, Event, Finish, SamplingParams, TokenEvent, check_prompt
from primerl.inference.engines.vllm_worker import WorkerExtension

if TYPE_CHECKING:
    from primerl.config.common import ModelConfig
    from primerl.config.inference import BroadcastReceiverSection, VLLMSection
    from primerl.transport.broadcast import Transfer
    from primerl.transport.broadcast_receiver import TransferFeed

log = logging.getLogger("primerl.inference")


class EngineUnavailable(RuntimeError):
    """The engine's package is not installed, or cannot serve what was asked; the message says what to do."""


class VLLMAPI(NamedTuple):
    """The vLLM classes the adapter uses, imported in one place (tests/inference/test_vllm_binding.py reads the same)."""

    AsyncEngineArgs: type
    AsyncLLM: type
    SamplingParams: type
    TokensPrompt: type
    RequestOutputKind: type


def vllm_api() -> VLLMAPI:
    """Import them (vllm is imported only when the engine starts)."""
    from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    return VLLMAPI(AsyncEngineArgs, AsyncLLM, SamplingParams, TokensPrompt, RequestOutputKind)


class VLLMEngine(Engine):
    """`Engine` over vLLM's AsyncLLM. Build it, `await start()` on the server's loop, then `generate`."""

    def __init__(
        self,
        model: ModelConfig,
        served_model_name: str,
        *,
        max_model_len: int | None,
        max_batch_size: int,
        options: VLLMSection,
        seed: int = 0,
    ) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise EngineUnavailable(
                "engine 'vllm' needs the vllm package, which is not installed here "
                "(install the GPU extra: pip install 'primerl[gpu]'), or use --engine hf"
            )
        try:
            self.vllm_version = vllm_compat.check_installed()
            vllm_compat.check_sleep_mode(self.vllm_version, options.sleep_level)
        except vllm_compat.UnsupportedVLLM as e:
            raise EngineUnavailable(str(e)) from None
        self.model_config = model
        self.model_name = served_model_name
        self.requested_max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.options = options
        self.seed = seed
        self.policy_version = 0
        self.device = "cuda"
        self.dtype = model.dtype
        self._api: VLLMAPI | None = None
        self._llm: Any = None
        self._paused_by_admin = False  # an admin pause outlives a weight update
        self._sleeping: set[str] = set()  # sleep-mode tags released by an admin pause: "weights", "kv_cache"
        self._update_lock = asyncio.Lock()  # one pause-load-reset-resume at a time
        self._segments: dict[str, list[tuple[int, int]]] = {}  # request id -> (first token index, version) runs
        self._receiver_task: asyncio.Task | None = None

    def engine_args(self, path: Path) -> dict[str, Any]:
        """The `AsyncEngineArgs` fields the adapter sets for the model at `path`, on the installed vLLM."""
        return {
            "model": str(path),
            "served_model_name": [self.model_name],
            "dtype": self.model_config.dtype,
            "trust_remote_code": self.model_config.trust_remote_code,
            "max_model_len": self.requested_max_model_len,
            "max_num_seqs": self.max_batch_size,
            "gpu_memory_utilization": self.options.gpu_memory_utilization,
            "tensor_parallel_size": self.options.tensor_parallel_size,
            "enforce_eager": self.options.enforce_eager,
            "enable_sleep_mode": self.options.sleep_level > 0,
            "seed": self.seed,
            "logprobs_mode": "processed_logprobs",
            "stream_interval": self.options.stream_interval,
            "worker_extension_cls": f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
            **vllm_compat.engine_overrides(self.vllm_version),
        }

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from primerl.models import resolve_model

        self._api = vllm_api()
        path = await asyncio.to_thread(resolve_model, self.model_config.name, self.model_config.revision)
        self._llm = self._api.AsyncLLM.from_engine_args(self._api.AsyncEngineArgs(**self.engine_args(path)))
        self.max_model_len = self._llm.model_config.max_model_len
        self.dtype = str(self._llm.model_config.dtype).removeprefix("torch.")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.model_config.trust_remote_code)
        self.eos_token_ids = _eos_token_ids(self._llm.model_config.hf_config, path, self.tokenizer)
        self.vocab_size = getattr(self._llm.model_config.hf_config, "vocab_size", 0) or 0

    async def stop(self) -> None:
        if self._receiver_task is not None:
            self._receiver_task.cancel()
            await asyncio.gather(self._receiver_task, return_exceptions=True)
            self._receiver_task = None
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def healthy(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[Event]:
        if not self.healthy():
            raise RuntimeError("engine is not running")
        check_prompt(prompt_ids, self.max_model_len)
        return self._stream(list(prompt_ids), params, request_id)

    async def _stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[Event]:
        api = self._api
        vllm_params = api.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(0, params.top_k),  # 0: the whole vocabulary
            max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_ids)),
            stop=list(params.stop) or None,
            detokenize=self.options.detokenize or bool(params.stop),  # text only where stop strings need it
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            seed=params.seed,  # None unless the client asked: keeps vLLM's batched sampling path
            logprobs=0,  # the sampled token's logprob only
            output_kind=api.RequestOutputKind.DELTA,
        )
        first = last = None
        completion = 0
        segments = self._segments[request_id] = [(0, self.policy_version)]  # a weight update appends to it
        run = 0  # the run of `segments` the next token falls in
        outputs = self._llm.generate(api.TokensPrompt(prompt_token_ids=prompt_ids), vllm_params, request_id)
        finished = False
        try:
            async for output in outputs:
                sample = output.outputs[0]
                logprobs = sampled_logprobs(sample.token_ids, sample.logprobs, completion, request_id)
                for token_id, logprob in zip(sample.token_ids, logprobs, strict=True):
                    while run + 1 < len(segments) and segments[run + 1][0] <= completion:
                        run += 1
                    last = segments[run][1]
                    first = last if first is None else first
                    completion += 1
                    yield TokenEvent(token_id, logprob, last)
                if output.finished:
                    finished = True
                    reason = sample.finish_reason if sample.finish_reason in ("stop", "length") else "abort"
                    versions = (first, last) if first is not None else (self.policy_version,) * 2
                    yield Finish(reason, versions, len(prompt_ids), completion, sample.stop_reason)
        finally:
            self._segments.pop(request_id, None)
            await outputs.aclose()
            if not finished and self._llm is not None:  # closed early (consumer gone) or failed: free the slot
                await self._llm.abort(request_id)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """vLLM's `prompt_logprobs=0` (the prompt tokens' own log-probs, from the raw logits) of a one-token request
        whose sampled token is dropped."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise RuntimeError("engine is not running")
        if len(token_ids) < 2:
            return []
        params = VLLMSamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in self._llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                               f"score-{uuid.uuid4().hex}"):
            final = output
        entries = final.prompt_logprobs if final is not None else None
        if entries is None or len(entries) != len(token_ids):
            raise RuntimeError(f"vLLM returned no prompt log-probs for a {len(token_ids)}-token sequence")
        return [float(entry[token].logprob) for entry, token in zip(entries[1:], token_ids[1:], strict=True)]

    def abort(self, request_id: str) -> None:
        if self._llm is not None:
            asyncio.ensure_future(self._llm.abort(request_id))

    async def update_weights(self, path: str | Path, step: int) -> None:
        path = Path(path)
        if not (sorted(path.glob("*.safetensors")) if path.is_dir() else path.is_file()):
            raise FileNotFoundError(f"no safetensors weights at {path}")
        await self._apply(step, "primerl_load_weights", str(path))

    async def load_shared_weights(self, snapshot: Path, run_dir: Path, step: int) -> None:
        await self._apply(step, "primerl_load_shared", str(snapshot), str(run_dir))

    async def _apply(self, step: int, method: str, *args: Any) -> list[Any]:
        """Pause, run worker `method(*args)` on every worker, reset the prefix cache with the running requests
        preempted, move the policy version to `step`, resume (unless paused by admin). Raises when a worker fails or
        the prefix cache was not reset; the policy version then stays, but unlike the embedded engine, which checks
        every name and shape first, vLLM's `load_weights` may have replaced some tensors already: load a complete
        version next."""
        async with self._update_lock:
            await self._wake(["weights"])  # the KV cache stays released until resume
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                sampled = await self._sampled_counts()
                results = await self._llm.collective_rpc(method, args=args)
                await self._reset_prefix_cache()
                self._move_version(step, sampled)
            finally:
                if not self._paused_by_admin:
                    await self._llm.resume_generation()
            return results

    async def _sampled_counts(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Tokens each request sampled before the pause that just completed (request id -> count). The engine sent
        their outputs before it answered the pause, on the one socket vLLM's reader takes in order into the output
        handler's queue; an empty output queued behind them is taken by the handler only once it has processed
        everything before it (it runs each output to the end before taking the next), and the handler's request
        states then hold every sampled token, whether handed to the stream yet or not."""
        handler = self._llm.output_handler  # started by the first request; nothing to wait for before it
        if handler is not None and not handler.done():
            from vllm.v1.engine import EngineCoreOutputs

            queue = self._llm.engine_core.outputs_queue
            queue.put_nowait(EngineCoreOutputs())
            deadline = asyncio.get_running_loop().time() + timeout_s
            while not queue.empty():
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"vLLM's output handler did not take its queue in {timeout_s:.0f} s")
                await asyncio.sleep(0.001)
        return {getattr(state, "external_req_id", None) or state.request_id: state.detokenizer.num_output_tokens()
                for state in list(self._llm.output_processor.request_states.values())}

    def _move_version(self, step: int, sampled: dict[str, int]) -> None:
        """The policy version becomes `step`: every request in flight samples its tokens from the `sampled[id]`th
        on (0 for one not started) under it."""
        for request_id, segments in self._segments.items():
            start = sampled.get(request_id, 0)
            if segments[-1][0] >= start:  # nothing sampled under the last version: it never applied
                segments[-1] = (segments[-1][0], step)
            else:
                segments.append((start, step))
        self.policy_version = step

    async def _reset_prefix_cache(self) -> None:
        """Drop every cached KV block computed by the old weights, preempting the requests in flight (they recompute
        their KV under the new weights); vLLM returns False when it could not."""
        if not await self._llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM did not reset its prefix cache after the weight update (KV blocks held by a "
                               "KV connector?); cached prefixes of the old weights would be reused")

    async def start_weight_receiver(self, settings: BroadcastReceiverSection) -> None:
        from primerl.transport.broadcast_receiver import TransferFeed

        await self._llm.collective_rpc(
            "primerl_broadcast_join", args=(settings.host, settings.port, settings.init_timeout_s, settings.timeout_s)
        )
        feed = TransferFeed(settings.host, settings.port, init_timeout_s=settings.init_timeout_s,
                            timeout_s=settings.timeout_s)
        self.receiver_state = f"joining the weight group at {settings.host}:{settings.port}"
        self._receiver_task = asyncio.create_task(self._follow_broadcasts(feed), name="weight-receiver")

    async def _follow_broadcasts(self, feed: TransferFeed) -> None:
        from primerl.transport.broadcast import GroupClosed, GroupFormationError

        try:
            await asyncio.to_thread(feed.connect)
            self.receiver_state = f"following the weight group at {feed.host}:{feed.port}"
            while True:
                transfer = await asyncio.to_thread(feed.next_transfer, 0.5)
                if transfer is not None:
                    await self._receive(feed, transfer)
        except GroupFormationError as e:
            self.receiver_state = f"failed: {e}"
            log.warning("weight broadcast: not joined, only filesystem snapshots can be loaded: %s", e)
        except GroupClosed as e:
            self.receiver_state = f"closed: {e}"
            log.info("weight broadcast: the group is closed (%s)", e)
        finally:
            feed.close()

    async def _receive(self, feed: TransferFeed, transfer: Transfer) -> None:
        import time

        started = time.perf_counter()
        results: list[dict[str, Any]] = []
        async with self._update_lock:
            await self._wake(["weights"])
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                sampled = await self._sampled_counts()
                results = await self._llm.collective_rpc("primerl_broadcast_receive", args=(transfer.to_dict(),))
                errors = [r["error"] for r in results if r["error"]]
                if not errors:
                    await self._reset_prefix_cache()
                    self._move_version(transfer.step, sampled)
            except Exception as e:  # noqa: BLE001 - no confirmation: the trainer times out and falls back
                errors = [f"{type(e).__name__}: {e}"]
            finally:
                if not self._paused_by_admin:
                    await self._llm.resume_generation()
        for result in results:
            if result["rank"] is not None:
                feed.answer(transfer, "done", result["rank"], errors[0] if errors else None)
        if errors:
            log.warning("weights step %d: broadcast not applied: %s", transfer.step, "; ".join(errors))
            return
        manifest = transfer.manifest
        log.info("weights: received step %d by broadcast on %d worker(s): %.1f MB in %d bucket(s) in %.2fs",
                 transfer.step, len(results), manifest.num_bytes / 1e6, len(manifest.buckets),
                 time.perf_counter() - started)

    async def pause(self) -> None:
        async with self._update_lock:
            self._paused_by_admin = True
            if self.options.sleep_level and not self._sleeping:
                await self._llm.sleep(level=self.options.sleep_level, mode="keep")
                self._sleeping = {"weights", "kv_cache"}
            else:
                await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        async with self._update_lock:
            self._paused_by_admin = False
            if self._sleeping and not vllm_compat.fully_awake(await self._wake(sorted(self._sleeping))):
                raise RuntimeError("vLLM did not wake up fully from sleep mode")
            await self._llm.resume_generation()

    async def _wake(self, tags: list[str]) -> Any:
        """Wake the sleeping parts among `tags`, each once: vLLM's allocator fails (CUDA invalid argument) when asked
        to map memory that is already awake, as a plain wake_up() after an update woke the weights did."""
        waking = [tag for tag in tags if tag in self._sleeping]
        if not waking:
            return None
        answer = await self._llm.wake_up(tags=waking)
        self._sleeping.difference_update(waking)
        return answer


def sampled_logprobs(token_ids: Any, logprobs: Any, offset: int, request_id: str) -> list[float]:
    """The logprob of each sampled token of one vLLM output delta (`CompletionOutput.token_ids` / `.logprobs`, one
    {token id: Logprob} mapping per position, the sampled token always among them with `logprobs=0`). A missing one
    is an error: the trainer would take a made-up number for the sampling policy's."""
    if len(token_ids) == 0:
        return []
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {0 if logprobs is None else len(logprobs)} logprobs for {len(token_ids)} "
                           f"sampled tokens of request {request_id} (from token {offset})")
    values = []
    for index, (token_id, position) in enumerate(zip(token_ids, logprobs, strict=True)):
        entry = position.get(token_id) if position is not None else None
        if entry is None:
            raise RuntimeError(f"vLLM returned no logprob for sampled token {token_id} at completion position "
                               f"{offset + index} of request {request_id}")
        values.append(float(entry.logprob))
    return values


def _eos_token_ids(hf_config: Any, path: Path, tokenizer: Any) -> frozenset[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        configured = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        configured = getattr(hf_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
