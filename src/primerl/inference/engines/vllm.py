"""The vLLM engine: the `Engine` contract (see `base`) over vLLM's `AsyncLLM` (vLLM 0.32, V1 engine), for GPUs.

UNTESTED in this repository's test suite: vllm is a GPU-only extra (`pip install 'primerl[gpu]'`) and cannot run on
the CPU machines the tests run on. It is written against vLLM's documented API: `AsyncLLM.from_engine_args`,
`generate(TokensPrompt, SamplingParams, request_id)` with `RequestOutputKind.DELTA`, `pause_generation(mode="keep")`
/ `resume_generation`, `collective_rpc` and `reset_prefix_cache`. vllm is imported only when this engine is built;
without it `VLLMEngine(...)` raises `EngineUnavailable`, which `primerl inference --engine vllm` reports in one line
(exit code 2).

How the contract maps onto vLLM:
- logprobs: the engine runs with `logprobs_mode="processed_logprobs"`, so the logprob of a sampled token is taken
  from the distribution it was sampled from (after temperature, top-k, top-p), as `base` requires.
- weight updates: pause (requests stay queued, mode "keep"), load the safetensors files on every worker through
  `WorkerExtension.primerl_load_weights` (the model's own `load_weights` maps checkpoint names onto vLLM's fused
  parameters), drop the prefix cache (its KV entries came from the old weights), set the policy version, resume.
  Tokens are stamped with the policy version current when their output reaches this process, so a token sampled
  just before a pause may carry the new version.
- weight broadcast (`start_weight_receiver`, docs/weights.md): every worker is one receiver rank of the trainer's
  weight group (`primerl_broadcast_join`, joining in a background thread of the worker). This process follows the
  trainer's announcements through the store (`TransferFeed`); for each it pauses, has every worker receive the
  buckets straight into its model (`primerl_broadcast_receive`: `load_weights` over the received tensors, bucket by
  bucket, no second copy of the model), drops the prefix cache, sets the policy version, confirms to the trainer
  for all its ranks and resumes. A worker that fails mid-transfer leaves the model partly updated; the trainer
  then falls back to writing that version in full, which the orchestrator loads over it.
  UNTESTED like the rest of this module (no vLLM, no GPU where the tests run).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.inference.engines.base import Engine, Event, Finish, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from primerl.config.common import ModelConfig
    from primerl.config.inference import BroadcastReceiverSection, VLLMSection
    from primerl.transport.broadcast import Transfer, TransferFeed

log = logging.getLogger("primerl.inference")


class EngineUnavailable(RuntimeError):
    """The engine's package is not installed; the message says how to get it."""


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`), called through `collective_rpc` on every worker:
    `primerl_load_weights` loads a weights directory into the running model; `primerl_broadcast_join` and
    `primerl_broadcast_receive` make the worker one receiver rank of the trainer's weight group."""

    def primerl_load_weights(self, path: str) -> int:
        from safetensors.torch import safe_open

        files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
        if not files:
            raise FileNotFoundError(f"no safetensors weights at {path}")

        def tensors() -> Any:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                        yield name, f.get_tensor(name)

        loaded = self.model_runner.get_model().load_weights(weights=tensors())  # type: ignore[attr-defined]
        return len(loaded) if loaded is not None else 0

    def primerl_broadcast_join(self, host: str, port: int, init_timeout_s: float, timeout_s: float) -> None:
        """Start joining the weight group as a receiver on this worker's GPU; returns at once (the join waits for
        the trainer, up to `init_timeout_s`, in a background thread so the worker keeps serving)."""
        import threading

        import torch

        from primerl.transport.broadcast import BroadcastReceiver

        receiver = BroadcastReceiver(host, port, device=torch.device("cuda", torch.cuda.current_device()),
                                     init_timeout_s=init_timeout_s, timeout_s=timeout_s)
        joined = threading.Event()
        self._primerl_receiver, self._primerl_joined, self._primerl_join_error = receiver, joined, None

        def join() -> None:
            try:
                receiver.join()
            except Exception as e:  # noqa: BLE001 - reported by primerl_broadcast_receive
                self._primerl_join_error = str(e)
            finally:
                joined.set()

        threading.Thread(target=join, name="primerl-weights-join", daemon=True).start()

    def primerl_broadcast_receive(self, transfer: dict[str, Any]) -> dict[str, Any]:
        """Receive one announced transfer (the engine is paused) into the model in place, bucket by bucket. Never
        raises: returns {"rank", "error", "seconds", "num_bytes"} so the engine can confirm for every rank."""
        import time

        from primerl.transport.broadcast import Transfer

        receiver = getattr(self, "_primerl_receiver", None)
        if receiver is None:
            return {"rank": None, "error": "primerl_broadcast_join was not called", "seconds": 0.0, "num_bytes": 0}
        self._primerl_joined.wait(receiver.feed.init_timeout_s)
        if receiver.rank is None:
            error = self._primerl_join_error or "not joined to the weight group yet"
            return {"rank": None, "error": error, "seconds": 0.0, "num_bytes": 0}
        announced = Transfer.from_dict(transfer)
        started = time.perf_counter()
        try:
            self.model_runner.get_model().load_weights(weights=receiver.receive(announced))  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - returned to the engine, which tells the trainer
            return {"rank": receiver.rank, "error": str(e).splitlines()[0] or type(e).__name__,
                    "seconds": time.perf_counter() - started, "num_bytes": 0}
        return {"rank": receiver.rank, "error": None, "seconds": time.perf_counter() - started,
                "num_bytes": announced.manifest.num_bytes}


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
    ) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise EngineUnavailable(
                "engine 'vllm' needs the vllm package, which is not installed here "
                "(install the GPU extra: pip install 'primerl[gpu]'), or use --engine hf"
            )
        self.model_config = model
        self.model_name = served_model_name
        self.requested_max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.options = options
        self.policy_version = 0
        self.device = "cuda"
        self.dtype = model.dtype
        self._llm: Any = None
        self._paused_by_admin = False  # an admin pause outlives a weight update
        self._receiver_task: asyncio.Task | None = None

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from primerl.models import resolve_model

        path = await asyncio.to_thread(resolve_model, self.model_config.name, self.model_config.revision)
        args = AsyncEngineArgs(
            model=str(path),
            served_model_name=[self.model_name],
            dtype=self.model_config.dtype,
            trust_remote_code=self.model_config.trust_remote_code,
            max_model_len=self.requested_max_model_len,
            max_num_seqs=self.max_batch_size,
            gpu_memory_utilization=self.options.gpu_memory_utilization,
            tensor_parallel_size=self.options.tensor_parallel_size,
            enforce_eager=self.options.enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.{WorkerExtension.__qualname__}",
        )
        self._llm = AsyncLLM.from_engine_args(args)
        self.max_model_len = self._llm.model_config.max_model_len
        self.dtype = str(self._llm.model_config.dtype).removeprefix("torch.")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.model_config.trust_remote_code)
        self.eos_token_ids = _eos_token_ids(self._llm.model_config.hf_config, path, self.tokenizer)

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
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len {self.max_model_len} leaves no room for a "
                "completion"
            )
        return self._stream(list(prompt_ids), params, request_id)

    async def _stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[Event]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        vllm_params = VLLMSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_ids)),
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            logprobs=0,  # the sampled token's logprob only
            output_kind=RequestOutputKind.DELTA,
        )
        first = last = None
        completion = 0
        async for output in self._llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), vllm_params, request_id):
            sample = output.outputs[0]
            version = self.policy_version
            for index, token_id in enumerate(sample.token_ids):
                logprob = sample.logprobs[index][token_id].logprob if sample.logprobs else 0.0
                first = version if first is None else first
                last = version
                completion += 1
                yield TokenEvent(token_id, logprob, version)
            if output.finished:
                reason = sample.finish_reason if sample.finish_reason in ("stop", "length") else "abort"
                versions = (first, last) if first is not None else (version, version)
                yield Finish(reason, versions, len(prompt_ids), completion, sample.stop_reason)

    def abort(self, request_id: str) -> None:
        if self._llm is not None:
            asyncio.ensure_future(self._llm.abort(request_id))

    async def update_weights(self, path: str | Path, step: int) -> None:
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._llm.collective_rpc("primerl_load_weights", args=(str(path),))
            await self._llm.reset_prefix_cache()
            self.policy_version = step
        finally:
            if not self._paused_by_admin:
                await self._llm.resume_generation()

    async def start_weight_receiver(self, settings: BroadcastReceiverSection) -> None:
        from primerl.transport.broadcast import TransferFeed

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
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            results = await self._llm.collective_rpc("primerl_broadcast_receive", args=(transfer.to_dict(),))
            errors = [r["error"] for r in results if r["error"]]
            if not errors:
                await self._llm.reset_prefix_cache()
                self.policy_version = transfer.step
        except Exception as e:  # noqa: BLE001 - a worker died: no confirmation, the trainer times out and falls back
            errors = [f"collective_rpc failed: {e}"]
        finally:
            if not self._paused_by_admin:
                await self._llm.resume_generation()
        for result in results:
            if result["rank"] is not None:
                feed.answer(transfer, "done", result["rank"], result["error"])
        if errors:
            log.warning("weights step %d: broadcast not applied: %s", transfer.step, "; ".join(errors))
            return
        manifest = transfer.manifest
        log.info("weights: received step %d by broadcast on %d worker(s): %.1f MB in %d bucket(s) in %.2fs",
                 transfer.step, len(results), manifest.num_bytes / 1e6, len(manifest.buckets),
                 time.perf_counter() - started)

    async def pause(self) -> None:
        self._paused_by_admin = True
        await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        self._paused_by_admin = False
        await self._llm.resume_generation()


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
