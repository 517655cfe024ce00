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
  `WeightLoaderExtension.primerl_load_weights` (the model's own `load_weights` maps checkpoint names onto vLLM's fused
  parameters), drop the prefix cache (its KV entries came from the old weights), set the policy version, resume.
  Tokens are stamped with the policy version current when their output reaches this process, so a token sampled
  just before a pause may carry the new version.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.inference.engines.base import Engine, Event, Finish, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from primerl.config.common import ModelConfig
    from primerl.config.inference import VLLMSection


class EngineUnavailable(RuntimeError):
    """The engine's package is not installed; the message says how to get it."""


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): loads a weights directory into the running model."""

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
            worker_extension_cls=f"{__name__}.{WeightLoaderExtension.__qualname__}",
        )
        self._llm = AsyncLLM.from_engine_args(args)
        self.max_model_len = self._llm.model_config.max_model_len
        self.dtype = str(self._llm.model_config.dtype).removeprefix("torch.")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.model_config.trust_remote_code)
        self.eos_token_ids = _eos_token_ids(self._llm.model_config.hf_config, path, self.tokenizer)

    async def stop(self) -> None:
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
