"""How many CPU threads one kvcodec call uses.

A section (one layer of one chunk) is small: handing its tensor operations to torch's intra-op pool costs more
than it saves, and on a busy machine (a serving machine is one) a pool whose threads wait for a free core turns
seconds into minutes (measured on a loaded 2-core machine: kivi encode 1.4 s on one thread, 38 s on torch's
default two).  So every encode and decode takes ``threads`` (default :data:`DEFAULT_THREADS`, one) as an
argument and passes it down: codecs get it in their :class:`~kvcodec.codecs.LayerContext`, and each codec call
runs through :func:`coding`, with torch on that many threads for the calling thread, restored after it, so that
the caller's own setting is in force between chunks; codecs whose sections code outside the GIL (kvfetcher: x265
and FFmpeg) code that many sections at once instead, on a :func:`section_pool`, each with torch on one thread.

Inside an engine that binds its threads to cores, ``torch.set_num_threads`` is not torch's: vLLM's CPU worker
replaces it with a function that logs a warning and changes nothing, so a load logged two warnings per layer per
chunk (360 lines for 1,408 tokens) and ran on the engine's count, not ``threads``.  torch's count is an OpenMP
setting of each native thread and the engine guards its own threads, so kvcodec sets the count, with torch's own
setter, only on threads it owns; called on another thread in such an engine, :func:`coding` runs the call on one
of kvcodec's threads (:func:`_workers`) and waits, the caller's grad and inference modes going with it.
Measured: one hand-over takes 12 us, against milliseconds for a section; in vLLM's server bound to 2 CPUs a
512-token cachegen load took 0.39-0.45 s, as before (0.41-0.43 s, with 120 warnings each).  torch's setter also
sets the count a thread starts with when it first uses torch (measured: set to 1 on one thread, a new thread
started with 1), which is why kvcodec's threads restore it after each call, as any caller's are.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from kvcodec.errors import InvalidInputError

T = TypeVar("T")

DEFAULT_THREADS = 1

#: torch's own setter; ``torch.set_num_threads`` is the same function unless an engine replaced it.
_TORCH_SET = torch._C.set_num_threads
_mine = threading.local()  # ``.owned`` on the threads kvcodec started
_workers_lock = threading.Lock()
_workers_pool: ThreadPoolExecutor | None = None


def check_threads(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidInputError(f"threads must be a positive integer, not {threads!r}")
    return threads


def _own() -> None:
    _mine.owned = True


def _owned() -> bool:
    return getattr(_mine, "owned", False)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for the calling thread, restored on exit.  On a thread kvcodec
    owns, with torch's own setter; on another, with ``torch.set_num_threads`` as it is now (the caller's)."""
    setter = _TORCH_SET if _owned() else torch.set_num_threads
    before = torch.get_num_threads()
    if threads != before:
        setter(threads)
    try:
        yield
    finally:
        if threads != before:
            setter(before)


def coding(threads: int, fn: Callable[[], T]) -> T:
    """``fn()``, a codec's encode or decode call, with torch on ``threads`` threads: on the calling thread, or on
    one of kvcodec's when an engine replaced ``torch.set_num_threads`` (see above) and the caller is not kvcodec's."""
    if _owned() or torch.set_num_threads is _TORCH_SET:
        with torch_threads(threads):
            return fn()
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def call() -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad), torch_threads(threads):
            return fn()
    return _workers().submit(call).result()


def _workers() -> ThreadPoolExecutor:
    """kvcodec's threads for :func:`coding`'s calls from an engine's threads, started once, as many as the
    engine's concurrent loads and saves need (up to Python's default pool size)."""
    global _workers_pool
    with _workers_lock:
        if _workers_pool is None:
            _workers_pool = ThreadPoolExecutor(thread_name_prefix="kvcodec-coding", initializer=_own)
        return _workers_pool


def _forget_workers() -> None:
    global _workers_lock, _workers_pool
    _workers_lock, _workers_pool = threading.Lock(), None


# a forked child has none of the parent's threads: a pool inherited from it would take calls and never run them
os.register_at_fork(after_in_child=_forget_workers)


def section_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads that kvcodec owns, for sections coded at once (:func:`torch_threads` there
    sets torch's count with torch's own setter, inside an engine or not)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="kvcodec-section", initializer=_own)
