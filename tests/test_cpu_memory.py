"""`primerl.cpu.keep_freed_memory`: a freed large block is reused without touching fresh pages (checked in a child
process, with glibc's own malloc: the setting is process-wide)."""

import platform
import subprocess
import sys

import pytest

CHILD = """
import ctypes, resource, sys
from primerl.cpu import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def faults_of_one_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 * 2**20)  # above glibc's largest mmap threshold: a mapping of its own by default
    ctypes.memset(block, 1, 64 * 2**20)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_block()  # the first block touches fresh pages either way
print(applied, max(faults_of_one_block() for _ in range(3)))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_page_faults():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
        applied, faults = out.stdout.split()
        return applied == "True", int(faults)

    applied, kept_faults = run("keep")
    _, default_faults = run("default")
    assert applied
    assert default_faults > 10_000  # 64 MiB of 4 KiB pages, mapped afresh every time
    assert kept_faults < 1_000
