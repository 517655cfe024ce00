"""What this machine's CPU offers torch's kernels (torch is imported only where asked: the checklist reads the
CPU's features without it)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bfloat16 with the CPU's bfloat16 dot products (AVX512-BF16 or AMX): where it does, a
    bfloat16 matmul runs about twice as fast as a float32 one (benchmarks/NOTES.md). oneDNN also reports bfloat16 as
    supported on AVX512 CPUs without those instructions, where it converts in software: a bfloat16 matmul there took
    4.5x the float32 one, so its answer alone is not enough."""
    import torch

    return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and cpu_has_bf16_dot_products() is not False)


BF16_DOT_FLAGS = {"avx512_bf16", "amx_bf16"}  # x86 (/proc/cpuinfo "flags")
BF16_DOT_FEATURES = {"bf16"}  # aarch64 (/proc/cpuinfo "Features": BFDOT, BFMMLA)


def cpu_has_bf16_dot_products(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU has bfloat16 dot-product instructions, from /proc/cpuinfo's flags (x86) or features (aarch64);
    None where that cannot be read (not Linux). Reads no torch state: the checklist's memory estimate asks too."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(set(value.split()) & (BF16_DOT_FLAGS | BF16_DOT_FEATURES))
    return None


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
    page faults (benchmarks/NOTES.md).

    The cost: memory does not stay at the process's peak, it grows past it. Blocks freed and allocated again every
    step (gradients, bfloat16 weight copies, logits) land between long-lived ones (oneDNN's cached kernels, about 7 MB
    per new input shape), so the free space fragments and later blocks no longer fit into it: the demo's trainer
    held 3.8 GB free against 1.6 GB in use after 100 steps. A trainer calls `trim_freed_memory` after each step to
    hand that free space back once it is large. Returns whether it applied (glibc only)."""
    libc = _glibc()
    if libc is None:
        return False
    global _kept
    _kept = (bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
             and bool(libc.mallopt(_M_ARENA_MAX, 1)))
    return _kept


def keeps_freed_memory() -> bool:
    """Whether `keep_freed_memory` applied in this process: memory freed now is reused by later allocations."""
    return _kept


TRIM_ABOVE_BYTES = 2**30  # free space in the heap above which `trim_freed_memory` hands it back
TRIM_GROWTH_BYTES = 2**28  # ... once it is also this much above the free space of the last trim
_trimmed_free = 0  # the free bytes of this process's heap when it last trimmed


class _Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33): sizes in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_bytes() -> tuple[int, int] | None:
    """(bytes in use, bytes free) in this process's malloc heap (glibc's `mallinfo2`), or None where it is not
    glibc's or too old to tell."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks), int(info.fordblks)


def trim_freed_memory(above_bytes: int = TRIM_ABOVE_BYTES, growth_bytes: int | None = TRIM_GROWTH_BYTES) -> int:
    """Where `keep_freed_memory` applied and the heap holds more than `above_bytes` free, and more than `growth_bytes`
    above what it held free at this process's last trim, hand the free pages back to the system (glibc's
    `malloc_trim(0)`): the heap's size then follows what the process uses instead of growing with its fragmentation.
    Otherwise nothing happens, so the step-to-step reuse `keep_freed_memory` is for is kept: a step that frees the
    same 1.2 GB every time (the demo's trainer) is trimmed once, not every step, where each trim cost ~0.1 s and the
    next step's page faults (2.7 % of the step; benchmarks/NOTES.md, "The long-run soak"); free space that keeps
    growing is trimmed at each `growth_bytes` more. `growth_bytes=None`: every call above `above_bytes` trims, for a
    process whose free space stays level while the pages a trim handed back are faulted in again, a few at a time, by
    allocations that land there (the CPU server). Returns the bytes that were free when it trimmed (0 when it did
    not)."""
    global _trimmed_free
    if not _kept:
        return 0
    heap = heap_bytes()
    floor = above_bytes if growth_bytes is None else max(above_bytes, _trimmed_free + growth_bytes)
    if heap is None or heap[1] <= floor:
        return 0
    libc = _glibc()
    assert libc is not None
    libc.malloc_trim(ctypes.c_size_t(0))
    _trimmed_free = heap[1]
    return heap[1]


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None
