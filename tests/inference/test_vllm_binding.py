"""The vLLM adapter bound to the vLLM installed here, on the CPU: the adapter's own code paths (start, generation,
abort, weight updates from a directory, the shared buffer and a broadcast, pause and resume with and without sleep
mode, stop) run against stand-ins for the vLLM objects that need a GPU (`AsyncLLM` and its model config). Every
call they make is bound to the real method's signature (`inspect.signature(...).bind`), every attribute they read
must exist on the real class, every `collective_rpc` target binds to `WorkerExtension` without clashing with vLLM's
worker, the engine arguments are real `AsyncEngineArgs` fields with values their types accept, and the sampling
parameters, prompts and outputs are vLLM's real classes.

It needs the `gpu` extra's vllm (not flash-attn). `bash ci/test-vllm.sh` runs it with uv.lock's vLLM and
`bash ci/test-cuda12.sh` with docker/cuda12/uv.lock's; both set PRIMERL_EXPECT_VLLM=1, which turns a missing vllm
into a failure instead of a skip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("PRIMERL_EXPECT_VLLM"):
        pytest.fail("PRIMERL_EXPECT_VLLM is set but vllm is not installed in this environment", pytrace=False)
    pytest.skip("vllm is not installed (the gpu extra): `bash ci/test-vllm.sh` runs these tests with it",
                allow_module_level=True)

from primerl.config.common import ModelConfig
from primerl.config.inference import BroadcastReceiverSection, VLLMSection
from primerl.inference.engines import vllm as adapter
from primerl.inference.engines import vllm_compat
from primerl.inference.engines.base import Finish, SamplingParams, TokenEvent
from primerl.inference.engines.vllm_worker import WorkerExtension

Call = tuple[str, tuple, dict]


def declares(cls: type, name: str) -> bool:
    """Whether instances of `cls` have attribute `name`: a class attribute, a dataclass field, or one an `__init__`
    of its classes assigns (read through decorators that wrap it)."""
    if hasattr(cls, name) or (dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}):
        return True
    inits = (getattr(inspect.unwrap(vars(klass)["__init__"]), "__code__", None)  # under a decorator's wrapper
             for klass in cls.__mro__ if "__init__" in vars(klass))
    return any(code is not None and name in code.co_names for code in inits)


def field_type(cls: type, name: str) -> Any:
    """The type of dataclass field `name`, its annotation evaluated in the module of the class that declares it."""
    declaring = next(klass for klass in cls.__mro__ if name in vars(klass).get("__annotations__", {}))
    annotation = vars(declaring)["__annotations__"][name]
    return eval(annotation, vars(sys.modules[declaring.__module__])) if isinstance(annotation, str) else annotation


def literal_rejects(hint: Any, value: Any) -> bool:
    """Whether `hint` (a Literal, or a union with Literals and no plain str) leaves out the string `value`."""
    options = [hint, *typing.get_args(hint)] if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint]
    literals = [typing.get_args(option) for option in options if typing.get_origin(option) is typing.Literal]
    return isinstance(value, str) and bool(literals) and str not in options and not any(value in v for v in literals)


def bind(cls: type, name: str, args: tuple, kwargs: dict) -> None:
    """Bind a call of `cls.name` (a method, classmethod or staticmethod) to its real signature: TypeError if it
    does not fit."""
    function = getattr(cls, name)
    assert callable(function), f"{cls.__qualname__}.{name} is not callable"
    unbound = not isinstance(inspect.getattr_static(cls, name), (classmethod, staticmethod))
    inspect.signature(function).bind(*((None,) if unbound else ()), *args, **kwargs)


def declared_result(function: Callable) -> Any:
    """A value of the declared return type of `function` (True for bool, else None)."""
    annotation = inspect.signature(function).return_annotation
    return True if annotation in (bool, "bool") else None


class Standin:
    """Stands for an instance (or the class itself) of a real vLLM class that cannot run here. A method call binds
    to the real signature and is recorded; it returns `results[name](*args, **kwargs)` when given, else a value of
    the declared return type, as a coroutine or async generator when the real method is one. An attribute must
    exist on the real class and be given."""

    def __init__(self, cls: type, calls: list[Call], results: dict[str, Callable] | None = None, **attributes: Any):
        self._cls, self._calls, self._results, self._attributes = cls, calls, results or {}, {}
        self.give(**attributes)

    def give(self, **attributes: Any) -> None:
        """More attributes (each must exist on the real class)."""
        missing = [name for name in attributes if not declares(self._cls, name)]
        assert not missing, f"{self._cls.__qualname__} has no attribute {missing}"
        self._attributes.update(attributes)

    def __getattr__(self, name: str) -> Any:
        if name in self._attributes:
            return self._attributes[name]
        assert declares(self._cls, name), f"the adapter reads {self._cls.__qualname__}.{name}, which vLLM lacks"
        function = getattr(self._cls, name)
        assert callable(function), f"the adapter reads {self._cls.__qualname__}.{name}, which the stand-in lacks"

        def call(*args: Any, **kwargs: Any) -> Any:
            bind(self._cls, name, args, kwargs)
            self._calls.append((name, args, kwargs))
            result = self._results[name](*args, **kwargs) if name in self._results else declared_result(function)
            if inspect.isasyncgenfunction(function):
                return _yield_each(result)
            if inspect.iscoroutinefunction(function):
                return _resolved(result)
            return result

        return call


async def _resolved(value: Any) -> Any:
    return value


async def _yield_each(values: Any):
    for value in values:
        yield value


@pytest.fixture(scope="module")
def api() -> adapter.VLLMAPI:
    return adapter.vllm_api()


@pytest.fixture(scope="module")
def version() -> tuple[int, int]:
    return vllm_compat.check_installed()


@pytest.fixture
def calls() -> list[Call]:
    return []


@pytest.fixture
def rpc_results() -> dict[str, Any]:
    """What each worker method returns (one worker): the number of tensors loaded, the broadcast receipt."""
    return {"primerl_load_weights": 3, "primerl_load_shared": 3, "primerl_broadcast_join": None,
            "primerl_broadcast_receive": {"rank": 0, "error": None, "seconds": 0.01, "num_bytes": 64}}


@pytest.fixture
def outputs() -> list[Any]:
    """What the stand-in AsyncLLM's `generate` yields."""
    return []


@pytest.fixture
def start_engine(api, calls, rpc_results, outputs, tiny_model_dir, monkeypatch):
    """`start_engine(sleep_level=0)`: a VLLMEngine on the tiny model, started through `start()` with a stand-in
    AsyncLLM whose model config says max_model_len 64 and float32."""
    from transformers import AutoConfig
    from vllm.config import ModelConfig as VLLMModelConfig
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.worker.gpu_worker import Worker

    def collective_rpc(method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        bind(WorkerExtension, method, args, kwargs or {})
        return [rpc_results[method]]

    model_config = Standin(VLLMModelConfig, calls, max_model_len=64, dtype="torch.float32",
                           hf_config=AutoConfig.from_pretrained(tiny_model_dir))
    llm = Standin(api.AsyncLLM, calls, {"collective_rpc": collective_rpc, "generate": lambda *a, **k: outputs},
                  model_config=model_config, errored=False, output_handler=None,  # no request yet: no handler
                  output_processor=Standin(OutputProcessor, calls, request_states={}))
    llm_class = Standin(api.AsyncLLM, calls, {"from_engine_args": lambda *a, **k: llm})
    monkeypatch.setattr(adapter, "vllm_api", lambda: api._replace(AsyncLLM=llm_class))
    clashes = [name for name in dir(WorkerExtension) if not name.startswith("__") and hasattr(Worker, name)]
    assert not clashes, f"vLLM's worker already has {clashes}: it would refuse the extension"

    def start(sleep_level: int = 0) -> adapter.VLLMEngine:
        engine = adapter.VLLMEngine(ModelConfig(name=str(tiny_model_dir)), "tiny", max_model_len=None,
                                    max_batch_size=4, options=VLLMSection(sleep_level=sleep_level), seed=3)
        asyncio.run(engine.start())
        return engine

    return start


def names(calls: list[Call]) -> list[str]:
    return [name if name != "collective_rpc" else f"collective_rpc:{args[0]}" for name, args, _ in calls]


def test_the_installed_vllm_is_supported(version):
    assert vllm_compat.OLDEST <= version <= vllm_compat.NEWEST


def test_engine_args_are_fields_of_async_engine_args_with_values_their_types_accept(api, version, tiny_model_dir):
    engine = adapter.VLLMEngine(ModelConfig(name=str(tiny_model_dir)), "tiny", max_model_len=256, max_batch_size=4,
                                options=VLLMSection(gpu_memory_utilization=0.3, enforce_eager=True), seed=3)
    arguments = engine.engine_args(tiny_model_dir)
    fields = {field.name for field in dataclasses.fields(api.AsyncEngineArgs)}
    assert not set(arguments) - fields, f"not fields of AsyncEngineArgs in vllm {version}: {set(arguments) - fields}"
    rejected = {name: value for name, value in arguments.items()
                if literal_rejects(field_type(api.AsyncEngineArgs, name), value)}
    assert not rejected, f"values vllm {version} does not accept: {rejected}"
    api.AsyncEngineArgs(**arguments)
    module, _, name = arguments["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is WorkerExtension


def test_start_builds_the_engine_from_real_engine_args(api, start_engine, calls):
    engine = start_engine()
    [(name, (engine_args,), kwargs)] = calls
    assert name == "from_engine_args" and isinstance(engine_args, api.AsyncEngineArgs) and not kwargs
    assert engine.max_model_len == 64 and engine.dtype == "float32" and engine.healthy()
    assert engine.eos_token_ids and engine.tokenizer is not None
    asyncio.run(engine.stop())
    assert names(calls)[-1] == "shutdown"


def real_output(api: adapter.VLLMAPI, token_ids: list[int], logprobs: list[float], finish: str | None) -> Any:
    """One DELTA RequestOutput of vLLM's own classes."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    sample = CompletionOutput(index=0, text="", token_ids=token_ids, cumulative_logprob=None,
                              logprobs=[{t: Logprob(logprob=v)} for t, v in zip(token_ids, logprobs, strict=True)],
                              finish_reason=finish, stop_reason=None)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3], prompt_logprobs=None,
                         outputs=[sample], finished=finish is not None)


async def collect(stream) -> list[Any]:
    return [event async for event in stream]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=8), SamplingParams(max_tokens=200, temperature=0.7, top_p=0.9, top_k=20, stop=["\n"],
                                                  stop_token_ids=[2], ignore_eos=True, seed=11)],
    ids=["defaults", "every-field"],
)
def test_generation_binds_and_reads_real_outputs(api, start_engine, calls, outputs, params):
    engine = start_engine()
    outputs[:] = [real_output(api, [5, 6], [-0.5, -1.0], None), real_output(api, [7], [-0.25], "length")]
    events = asyncio.run(collect(engine.generate([1, 2, 3], params, "req-1")))
    assert events == [TokenEvent(5, -0.5, 0), TokenEvent(6, -1.0, 0), TokenEvent(7, -0.25, 0),
                      Finish("length", (0, 0), 3, 3, None)]
    [(_, (prompt, sampling, request_id), _)] = [call for call in calls if call[0] == "generate"]
    assert request_id == "req-1" and isinstance(sampling, api.SamplingParams)
    assert api.TokensPrompt.__required_keys__ <= set(prompt) <= (
        api.TokensPrompt.__required_keys__ | api.TokensPrompt.__optional_keys__)
    assert sampling.output_kind == api.RequestOutputKind.DELTA and sampling.logprobs == 0
    assert sampling.max_tokens == min(params.max_tokens, 64 - 3)
    assert sampling.detokenize == bool(params.stop)  # vLLM's text only where stop strings are matched on it
    asyncio.run(engine.stop())


def test_a_stream_closed_early_and_an_abort_free_the_request(api, start_engine, calls, outputs):
    engine = start_engine()
    outputs[:] = [real_output(api, [5], [-0.5], None), real_output(api, [6], [-0.5], None)]

    async def first_token_then_close() -> None:
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=8), "req-2")
        await anext(stream)
        await stream.aclose()
        engine.abort("req-3")
        await asyncio.sleep(0)  # the abort is scheduled on the loop

    asyncio.run(first_token_then_close())
    assert [args for name, args, _ in calls if name == "abort"] == [("req-2",), ("req-3",)]


def test_weight_updates_bind(start_engine, calls, tiny_model_dir, tmp_path):
    engine = start_engine()
    asyncio.run(engine.update_weights(tiny_model_dir, step=1))
    asyncio.run(engine.load_shared_weights(tmp_path / "SHARED-2", tmp_path, step=2))
    apply = ["pause_generation", "collective_rpc:{}", "reset_prefix_cache", "resume_generation"]
    assert names(calls)[1:] == [n.format("primerl_load_weights") for n in apply] + [
        n.format("primerl_load_shared") for n in apply]
    assert engine.policy_version == 2


def test_tokens_sampled_before_an_update_keep_their_version_though_handed_over_after_it(api, start_engine, calls,
                                                                                        outputs, tiny_model_dir):
    """vLLM hands a request its tokens every `stream_interval` steps, so when a weight update pauses the engine some
    tokens sampled under the old weights are still held back in its output handler's request state. The update
    queues a marker behind what the engine sent before the pause completed, waits for the handler to take it, and
    starts the new version at the count the request state then holds: tokens 7 and 8 (handed over after the update)
    keep version 0, token 9 on has version 1."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer
    from vllm.v1.engine.output_processor import RequestState

    engine = start_engine()
    outputs[:] = [real_output(api, [5, 6], [-0.5, -0.5], None), real_output(api, [7, 8, 9], [-0.5] * 3, None),
                  real_output(api, [10], [-0.5], "length")]
    sampled = {"tokens": 4}  # 5 to 8 sampled by the pause, 5 and 6 handed to the stream
    detokenizer = Standin(IncrementalDetokenizer, calls, {"num_output_tokens": lambda: sampled["tokens"]})
    ids = {"external_req_id": "req-v", "request_id": "req-v-1"} if declares(RequestState, "external_req_id") \
        else {"request_id": "req-v"}
    engine._llm.output_processor.give(request_states={ids["request_id"]: Standin(RequestState, calls,
                                                                                 detokenizer=detokenizer, **ids)})
    taken: list[Any] = []

    async def scenario() -> list[Any]:
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(EngineCoreOutputs())  # an output of the engine still queued when the pause completed

        async def handler() -> None:  # vLLM's output handler: each queued output processed in turn
            while True:
                taken.append(await queue.get())
                await asyncio.sleep(0.01)

        task = asyncio.create_task(handler())
        engine._llm.give(output_handler=task, engine_core=Standin(AsyncMPClient, calls, outputs_queue=queue))
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=8), "req-v")
        events = [await anext(stream), await anext(stream)]
        await engine.update_weights(tiny_model_dir, step=1)
        assert len(taken) == 2 and queue.empty(), "the update read the counts before the handler took its queue"
        events += [event async for event in stream]
        task.cancel()
        return events

    events = asyncio.run(scenario())
    assert [(e.token_id, e.policy_version) for e in events[:-1]] == [(5, 0), (6, 0), (7, 0), (8, 0), (9, 1), (10, 1)]
    assert events[-1] == Finish("length", (0, 1), 3, 6, None)
    assert all(isinstance(output, EngineCoreOutputs) and not output.outputs for output in taken)


def test_a_broadcast_transfer_binds(start_engine, calls):
    """Joining the trainer's weight group, then one announced transfer, confirmed through a real weight store."""
    import torch.distributed as dist

    from primerl.transport import broadcast
    from primerl.transport.broadcast_receiver import TransferFeed
    from primerl.transport.buckets import Bucket, Manifest, TensorEntry

    host_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore(broadcast._KEY_PREFIX, host_store)
    store.set(broadcast._Keys.group_id, "group")  # what the trainer writes first
    settings = BroadcastReceiverSection(host="127.0.0.1", port=host_store.port, init_timeout_s=5, timeout_s=5)
    feed = TransferFeed(settings.host, settings.port, init_timeout_s=5, timeout_s=5)
    feed.connect()
    manifest = Manifest((Bucket(64, (TensorEntry("w", "float32", (4, 4), 0),)),))
    engine = start_engine()

    async def join_then_receive() -> None:
        await engine.start_weight_receiver(settings)
        await engine._receive(feed, broadcast.Transfer(1, 5, "t-1", manifest))
        await engine.stop()

    asyncio.run(join_then_receive())
    assert names(calls)[1:] == ["collective_rpc:primerl_broadcast_join", "pause_generation",
                                "collective_rpc:primerl_broadcast_receive", "reset_prefix_cache",
                                "resume_generation", "shutdown"]
    assert engine.policy_version == 5 and store.get(broadcast._Keys.transfer(1, "done", 0)) == b"ok"


def test_pause_and_resume_bind(start_engine, calls, tiny_model_dir):
    engine = start_engine()
    asyncio.run(engine.pause())
    asyncio.run(engine.update_weights(tiny_model_dir, step=1))  # an update while paused leaves it paused
    asyncio.run(engine.resume())
    assert names(calls)[1:] == ["pause_generation", "pause_generation", "collective_rpc:primerl_load_weights",
                                "reset_prefix_cache", "resume_generation"]


def test_sleep_mode_binds_or_is_refused_in_one_line(version, start_engine, calls, tiny_model_dir):
    if version < vllm_compat.FIXED_RESET_AND_WAKE:
        with pytest.raises(adapter.EngineUnavailable) as refused:
            start_engine(sleep_level=1)
        assert "\n" not in str(refused.value) and "vllm.sleep_level" in str(refused.value)
        return
    engine = start_engine(sleep_level=1)
    asyncio.run(engine.pause())
    asyncio.run(engine.update_weights(tiny_model_dir, step=1))  # wakes the weights alone
    asyncio.run(engine.resume())  # wakes the KV cache, once
    assert calls[1:] == [
        ("sleep", (), {"level": 1, "mode": "keep"}),
        ("wake_up", (), {"tags": ["weights"]}),
        ("pause_generation", (), {"mode": "keep", "clear_cache": False}),
        ("collective_rpc", ("primerl_load_weights",), {"args": (str(tiny_model_dir),)}),
        ("reset_prefix_cache", (), {"reset_running_requests": True}),
        ("wake_up", (), {"tags": ["kv_cache"]}),
        ("resume_generation", (), {}),
    ]
