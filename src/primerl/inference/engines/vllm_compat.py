"""What the vLLM adapter needs to know about the installed vLLM, keyed on `vllm.__version__` (no vllm import here).

The adapter supports vLLM 0.26 through 0.32 (the GPU machines' 0.26.0, the lock's 0.32.0). Read against both
versions' sources, the calls it makes agree: `AsyncLLM.from_engine_args`, `generate(TokensPrompt, SamplingParams,
request_id)` with `RequestOutputKind.DELTA` (both from `vllm.sampling_params` / `vllm.inputs`),
`pause_generation(mode="keep", clear_cache=...)` / `resume_generation()`, `reset_prefix_cache(reset_running_requests,
reset_connector) -> bool` (the scheduler resets a prefix cache still referenced by running requests only when they
are preempted first, `reset_running_requests=True`), `collective_rpc(method, timeout, args, kwargs)`,
`sleep(level, mode)`, the `AsyncEngineArgs` fields `logprobs_mode`, `worker_extension_cls`, `enable_sleep_mode`,
`gpu_memory_utilization`, `seed`. They differ in what `wake_up` returns: nothing on 0.26, on 0.32 whether every
allocation is resident again (`fully_awake` reads both). A vLLM outside the range is refused in one line.
"""

from __future__ import annotations

import re

OLDEST = (0, 26)
NEWEST = (0, 32)


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is outside the versions the adapter was written against."""


def fully_awake(wake_up_result: bool | None) -> bool:
    """Whether `AsyncLLM.wake_up()` (all tags) left every allocation resident and the scheduler running: 0.32 says
    so (False when a tag stayed asleep), 0.26 returns None and always wakes everything it was asked to."""
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
            f"vllm {version} is not supported by primerl's vLLM engine (supported: "
            f"{'.'.join(map(str, OLDEST))} to {'.'.join(map(str, NEWEST))}); install a supported vllm or use "
            "--inference.engine hf"
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
