"""kvcodec.memory: glibc's allocator told to give memory back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcodec import memory

pytestmark = pytest.mark.skipif(memory._libc() is None, reason="not glibc")

# Run in a fresh process: what a 16 MiB block freed leaves resident, in bytes.  The thresholds are set where
# glibc's moving ones can come to after a model run: the block is served from the heap, which keeps it when freed.
FREED_BLOCK = """
import ctypes
from kvcodec import memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
{before}
start = rss()
p = libc.malloc(16 << 20)
ctypes.memset(p, 1, 16 << 20)
libc.free(p)
{after}
print(rss() - start)
"""


def _left_resident(before: str = "", after: str = "") -> int:
    code = FREED_BLOCK.format(before=before, after=after)
    return int(subprocess.check_output([sys.executable, "-c", code], text=True))


def test_a_freed_block_stays_resident_without_them():
    assert _left_resident() > 12 << 20  # what the two tests below change


def test_a_large_block_allocated_after_map_large_blocks_is_given_back_when_freed():
    assert _left_resident(before="memory.map_large_blocks(8 << 20)") < 4 << 20


def test_return_freed_memory_gives_back_what_the_heap_kept():
    assert _left_resident(after="memory.return_freed_memory()") < 4 << 20
