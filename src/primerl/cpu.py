"""What this machine's CPU offers torch's kernels."""

from __future__ import annotations

import ctypes
import platform

import torch


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bfloat16 with the CPU's bfloat16 dot products (AVX512-BF16 or AMX): where it does, a
    bfloat16 matmul runs about twice as fast as a float32 one (benchmarks/NOTES.md)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_kept = False  # whether keep_freed_memory applied in this process


def keep_freed_memory() -> bool:
    """Make this process's malloc (glibc) keep the memory it frees for its next allocations instead of handing it back
    to the system: no block gets a mapping of its own (glibc maps every block above 32 MB afresh, e.g. a trainer's
    [tokens, vocabulary] logits and its [vocabulary, hidden] gradients, and unmaps it when freed), the heap is not
    trimmed below 2 GiB of free space, and every thread allocates from the one heap (with a heap per thread, blocks
    freed by one thread, e.g. a server's loader, are of no use to another, e.g. its engine's). A CPU trainer step
    otherwise touches fresh pages for all of those every step: on a shared 2-core machine a third of its time went to
    page faults (benchmarks/NOTES.md). Memory stays at the process's peak. Returns whether it applied (glibc only)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    global _kept
    _kept = (bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
             and bool(libc.mallopt(_M_ARENA_MAX, 1)))
    return _kept


def keeps_freed_memory() -> bool:
    """Whether `keep_freed_memory` applied in this process: memory freed now is reused by later allocations."""
    return _kept

