"""`primerl.cpu.keep_freed_memory`: a freed large block is reused without touching fresh pages, also by another thread
than the one that freed it (checked in a child process, with glibc's own malloc: the setting is process-wide)."""

import platform
import subprocess
import sys

import pytest

# both children: keep freed memory or not (argv[1]), then glibc's own malloc and free through ctypes
PREAMBLE = """
import ctypes, resource, sys
from primerl.cpu import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
"""

CHILD = PREAMBLE + """
def faults_of_one_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 * 2**20)  # above glibc's largest mmap threshold: a mapping of its own by default
    ctypes.memset(block, 1, 64 * 2**20)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_block()  # the first block touches fresh pages either way
print(applied, max(faults_of_one_block() for _ in range(3)))
"""


ACROSS_THREADS = PREAMBLE + """
import threading
SIZE = 16 * 2**20  # below glibc's mmap threshold once it has grown: a thread's own heap holds it by default
freed, done = threading.Event(), threading.Event()
faults = []
def first():  # e.g. a server's loader thread: allocates, touches and frees a block, and lives on
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)
    freed.set()
    done.wait()
def second():  # e.g. its engine thread, allocating the same size later
    freed.wait()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    libc.free(block)
    done.set()
threads = [threading.Thread(target=first), threading.Thread(target=second)]
for t in threads: t.start()
for t in threads: t.join()
print(applied, faults[0])
"""


glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")


def run(script: str, mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@glibc_only
def test_freed_blocks_are_reused_without_page_faults():
    applied, kept_faults = run(CHILD, "keep")
    _, default_faults = run(CHILD, "default")
    assert applied
    assert default_faults > 10_000  # 64 MiB of 4 KiB pages, mapped afresh every time
    assert kept_faults < 1_000


@glibc_only
def test_a_block_freed_by_one_thread_is_reused_by_another():
    applied, kept_faults = run(ACROSS_THREADS, "keep")
    _, default_faults = run(ACROSS_THREADS, "default")
    assert applied
    assert default_faults > 3_000  # 16 MiB of 4 KiB pages in the second thread's own heap
    assert kept_faults < 500


FRAGMENTED = PREAMBLE + """
from primerl.cpu import heap_bytes, trim_freed_memory
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
blocks = []
for _ in range(48):  # 48 blocks of 32 MiB, each followed by a small block that stays: the free space cannot shrink
    blocks.append(libc.malloc(32 * 2**20))
    ctypes.memset(blocks[-1], 1, 32 * 2**20)
    libc.malloc(4096)
for block in blocks:
    libc.free(block)
before, fragmented = resident_mb(), heap_bytes()[1] > 2**30
small = trim_freed_memory(above_bytes=2 * 2**30)  # 1.5 GiB free: below this threshold, nothing happens
kept = resident_mb()
trimmed = trim_freed_memory(above_bytes=2**30)
print(applied, fragmented, small, round(before - kept), trimmed > 2**30, round(before - resident_mb()))
"""


@glibc_only
def test_trim_hands_back_the_free_space_of_a_fragmented_heap_above_the_threshold():
    out = subprocess.run([sys.executable, "-c", FRAGMENTED, "keep"], capture_output=True, text=True, check=True)
    applied, fragmented, below, kept_mb, trimmed, handed_back_mb = out.stdout.split()
    assert applied == "True" and fragmented == "True"
    assert below == "0" and abs(int(kept_mb)) < 16  # under the threshold the freed pages stay for reuse
    assert trimmed == "True" and int(handed_back_mb) > 1200  # ~1.5 GiB of freed blocks handed back


@glibc_only
def test_trim_does_nothing_where_freed_memory_is_not_kept():
    out = subprocess.run([sys.executable, "-c", FRAGMENTED, "default"], capture_output=True, text=True, check=True)
    applied, _, below, _, trimmed, _ = out.stdout.split()
    assert applied == "False" and below == "0" and trimmed == "False"


INTEL_NO_BF16 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor @ 2.80GHz
flags\t\t: fpu vme avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni
"""
INTEL_AMX = INTEL_NO_BF16.replace("avx512_vnni", "avx512_vnni avx512_bf16 amx_bf16 amx_tile")
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 i8mm\n"
ARM_NO_BF16 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32\n"


@pytest.mark.parametrize("cpuinfo, expected", [
    (INTEL_NO_BF16, False), (INTEL_AMX, True), (ARM_BF16, True), (ARM_NO_BF16, False), ("processor\t: 0\n", None),
], ids=["avx512-without-bf16", "amx", "arm-bf16", "arm-without", "no-flags"])
def test_bf16_dot_products_are_read_from_the_cpu_flags(cpuinfo, expected):
    """"avx512_bf16" must be a whole flag: a CPU with only avx512f/avx512_vnni has none (oneDNN's own answer says
    yes there, and its software bfloat16 was 4.5x slower than float32)."""
    from primerl.cpu import cpu_has_bf16_dot_products

    assert cpu_has_bf16_dot_products(cpuinfo) is expected
