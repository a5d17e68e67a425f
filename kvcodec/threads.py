"""How many CPU threads one kvcodec call uses.

A section (one layer of one chunk) is small: handing its tensor operations to torch's intra-op pool costs more
than it saves, and on a busy machine (a serving machine is one) a pool whose threads wait for a free core turns
seconds into minutes (measured on a loaded 2-core machine: kivi encode 1.4 s on one thread, 38 s on torch's
default two).  So every encode and decode takes ``threads`` (default :data:`DEFAULT_THREADS`, one) as an
argument and passes it down: codecs get it in their :class:`~kvcodec.codecs.LayerContext`, and torch runs on that
many threads around each codec call (:func:`kvcodec.chunking.coding`, for the calling thread, restored after it, so
that the caller's own setting is in force between chunks); codecs whose sections code outside the GIL (kvfetcher:
x265 and FFmpeg) code that many sections at once instead, each with torch on one thread.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from kvcodec.errors import InvalidInputError

DEFAULT_THREADS = 1


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
