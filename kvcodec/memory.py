"""Resident memory of kvcodec's long CPU jobs (calibrating a model): what glibc's allocator keeps after a free.

glibc serves a block under its mmap threshold from its heaps and keeps it there once freed; above the threshold a
block is mapped on its own and unmapped when freed.  The threshold starts at 128 KiB and rises to the size of any
mapped block freed (up to 32 MiB), so after a model run the activations' sizes land in the heaps, and a later job's
large arrays are mapped beside the memory the heaps kept.  Elsewhere (not glibc) both calls do nothing.
"""

from __future__ import annotations

import ctypes
import gc

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h

# Measured with `kvcodec calibrate --model gemma3-270m --loss-weights yes` on 2 idle cores (peak resident
# memory, wall time): the moving threshold 2.73 and 2.96 GB, 2 min 10 s; fixed at 1 MiB 2.71, 2.71, 2.71 GB but
# 2 min 27 s (the model run's activations mapped and faulted in afresh each time); at 8 MiB 2.84 and 2.77 GB,
# 2 min 2 s.  The same calibration file each time.
LARGE_BLOCK = 8 << 20


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_freed_memory() -> None:
    """Collect garbage and hand the heaps' free memory back to the OS (before a job's peak: a model let go may be
    held in reference cycles, and its freed blocks in the heaps)."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def map_large_blocks(threshold: int = LARGE_BLOCK) -> None:
    """From now on, for the whole process, blocks of at least ``threshold`` bytes are mapped on their own and
    given back when freed, whatever was freed before.  For a process kvcodec owns (its command line), not a host
    it is loaded into."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold))
