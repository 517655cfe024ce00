"""NVLink multicast stays off in every process primerl starts, unless the user set the variables themselves.

NCCL's NVLS algorithms, PyTorch's symmetric memory and NVSHMEM can all create NVLink multicast objects, a resource of
the whole host rather than of one process. On hosts whose GPUs are shared (cloud machines, lent machines) a process
that uses them can leave the host's GPUs unusable for others, so primerl turns them off by default. What they buy is
speed for some collectives on NVSwitch systems; where the host allows it, set e.g. `NCCL_NVLS_ENABLE=1` yourself and
the setting is kept (only unset variables get these defaults).
"""

from __future__ import annotations

from collections.abc import MutableMapping

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",  # NCCL: no NVLink SHARP (NVLS) algorithms
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",  # PyTorch symmetric memory: no multicast objects
    "NVSHMEM_DISABLE_NVLS": "1",  # NVSHMEM (used by symmetric memory): no NVLS
}


def multicast_off(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Set each variable of `MULTICAST_OFF` in `env` unless it is already set; return `env`."""
    for name, value in MULTICAST_OFF.items():
        env.setdefault(name, value)
    return env
