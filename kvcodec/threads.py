"""How many CPU threads one kvcodec call uses.

A section (one layer of one chunk) is small: handing its tensor operations to torch's intra-op pool costs more
than it saves, and on a busy machine (a serving machine is one) a pool whose threads wait for a free core turns
seconds into minutes (measured on a loaded 2-core machine: kivi encode 1.4 s on one thread, 38 s on torch's
default two).  So every encode and decode runs torch on ``threads`` threads (default :data:`DEFAULT_THREADS`,
one), set for the calling thread during the call and restored after it; codecs whose sections code outside the
GIL (kvfetcher: x265 and FFmpeg) code that many sections at once instead, each with torch on one thread.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, TypeVar

import torch

from kvcodec.errors import InvalidInputError

DEFAULT_THREADS = 1
T = TypeVar("T")


def check_threads(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidInputError(f"threads must be a positive integer, not {threads!r}")
    return threads


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for the calling thread, restored on exit."""
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads != before:
            torch.set_num_threads(before)


def iter_with_threads(pieces: Iterator[T], threads: int) -> Iterator[T]:
    """``pieces`` produced under :func:`torch_threads` (for lazy encoders: the work happens in ``next``), with
    the caller's own setting in force between pieces."""
    while True:
        with torch_threads(threads):
            try:
                piece = next(pieces)
            except StopIteration:
                return
        yield piece
