"""What the vLLM adapter needs to know about the installed vLLM, keyed on its version (no vllm import here).

Supported: vLLM 0.19 (primerl:cuda12's lock, docker/cuda12/uv.lock) through 0.32 (uv.lock, primerl:cuda13); the
adapter was read against the sources of 0.19.0, 0.26.0 (the GPU machines' vLLM) and 0.32.0. In all three the calls it
makes have the same signatures (tests/inference/test_vllm_binding.py binds every one to the installed vLLM):
`AsyncLLM.from_engine_args`, `generate(TokensPrompt, SamplingParams, request_id)` with `RequestOutputKind.DELTA`,
`abort`, `pause_generation(mode="keep", clear_cache=...)` / `resume_generation()`,
`reset_prefix_cache(reset_running_requests, reset_connector) -> bool`, `collective_rpc(method, timeout, args,
kwargs)`, `sleep(level, mode)`, `wake_up(tags)`, and the `AsyncEngineArgs` fields `logprobs_mode`
("processed_logprobs": the distribution after temperature, top-k and top-p), `worker_extension_cls`,
`enable_sleep_mode`, `gpu_memory_utilization`, `seed`, `async_scheduling`. A pause with mode "keep" completes once
no step is in flight, and `reset_prefix_cache(reset_running_requests=True)` preempts the running requests (they
recompute their KV when generation resumes) in all three. What differs:

- The reset of running requests under async scheduling (vLLM's default). Before 0.26 the reset marks every preempted
  request so that the async scheduler drops its next output, meant for an output still in flight; after a completed
  pause none is, so the first token computed after the resume is dropped while the model's KV keeps it: the tokens
  a client sees and the model's context part by one (vLLM issue 42043, fixed in 0.26, where only outputs still in
  flight are dropped). On vLLM < 0.26 the adapter starts the engine with `async_scheduling=False`: the synchronous
  scheduler never drops an output, at some decode speed.
- Sleep mode. Before 0.26 `wake_up(tags=["weights"])` also resumes scheduling while the KV cache is still released,
  so a request waiting in vLLM runs a forward pass into freed memory (illegal memory access, vLLM issue 44395, fixed
  in 0.26: a partial wake keeps the scheduler paused). A weight update while asleep needs exactly that partial wake
  (waking the KV cache too would take back the memory sleep gave the trainer), so `vllm.sleep_level = 1` is refused
  on vLLM < 0.26, in one line, when the engine is built.
- What `wake_up` returns: nothing up to 0.26, whether every allocation is resident again on 0.32 (`fully_awake`
  reads both).

Versions between 0.19 and 0.26 were not read: they get 0.19's treatment, which is safe for them either way.
"""

from __future__ import annotations

import re

OLDEST = (0, 19)
NEWEST = (0, 32)
FIXED_RESET_AND_WAKE = (0, 26)  # the first version read with both fixes above


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is outside the versions the adapter was written against, or lacks a feature asked for."""


def _dotted(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def engine_overrides(version: tuple[int, int]) -> dict[str, object]:
    """`AsyncEngineArgs` fields vLLM `version` needs beyond the adapter's own: the synchronous scheduler before
    0.26, whose async scheduler drops the first token of each request preempted by a weight update."""
    return {} if version >= FIXED_RESET_AND_WAKE else {"async_scheduling": False}


def check_sleep_mode(version: tuple[int, int], sleep_level: int) -> None:
    """UnsupportedVLLM when `sleep_level` asks for sleep mode on a vLLM whose partial wake resumes scheduling."""
    if sleep_level and version < FIXED_RESET_AND_WAKE:
        raise UnsupportedVLLM(
            f"vllm.sleep_level = {sleep_level} needs vllm {_dotted(FIXED_RESET_AND_WAKE)} or newer: vllm "
            f"{_dotted(version)} resumes generation when only the weights wake, so a weight update while asleep would "
            "run waiting requests on the released KV cache; set vllm.sleep_level = 0 here"
        )


def fully_awake(wake_up_result: bool | None) -> bool:
    """Whether `AsyncLLM.wake_up()` left every allocation resident and the scheduler running: 0.32 says so (False
    when a tag stayed asleep), older versions return None and always wake everything they were asked to."""
    return True if wake_up_result is None else bool(wake_up_result)


def check_version(version: str) -> tuple[int, int]:
    """(major, minor) of vLLM `version` (e.g. "0.26.0", "0.32.0+cu130", "0.27.0rc1.dev5"); UnsupportedVLLM outside
    the supported range or for a version string that does not start with major.minor."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedVLLM(f"cannot read the vllm version {version!r}")
    major_minor = (int(match[1]), int(match[2]))
    if not OLDEST <= major_minor <= NEWEST:
        raise UnsupportedVLLM(
            f"vllm {version} is not supported by primerl's vLLM engine (supported: {_dotted(OLDEST)} to "
            f"{_dotted(NEWEST)}); install a supported vllm or use --inference.engine hf"
        )
    return major_minor


def check_installed() -> tuple[int, int]:
    """`check_version` of the installed vllm: from its package metadata, else from `vllm.version`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return check_version(version("vllm"))
    except PackageNotFoundError:  # importable without its metadata (copied onto the path)
        from vllm.version import __version__

        return check_version(__version__)
