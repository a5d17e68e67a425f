"""The worker's saves, written behind the forward pass: a prompt's KV is copied out of vLLM's paged memory during
its step, then encoded and put into the store by a thread of its own.

Why behind: vLLM emits a step's tokens only after the connector's ``wait_for_save`` returns, so a save inside the
step delays the first token by the slowest tier's write.  Measured inside vLLM (CPU, SmolLM2, 3,852-token prompts,
raw into Redis behind tbf): a miss over 100 Mbit/s took 2.0-2.3x a plain prefill while its save ran in the step.

Why one thread: saves reach the store in the order their steps ran, so a later prompt that extends an earlier one
finds its prefix chunks already written (and writes only its new ones), and a save never competes with another for
the link.  The KV waiting is bounded (``max_bytes``): a step that would pass the bound waits for room, so a burst of
misses on a slow link cannot grow host memory without end; a save is never dropped, not even when the process
exits without vLLM shutting its connector down (the saves still waiting are written at exit).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

#: KV copied out of vLLM's memory and not yet written, at most (bytes): two SmolLM2 prompts of 4,000 tokens in
#: float32 are 0.37 GB, one Llama-3-8B prompt of 8,000 tokens in bfloat16 1 GB.
MAX_PENDING_BYTES = 2 << 30


class BackgroundSaves:
    """Runs submitted saves one after another on a thread of its own, at most ``max_bytes`` of them waiting.

    ``submit`` hands over a save; ``take_ran`` says which saves have run since it was last asked (succeeded or
    failed: a save's own errors are its to log); ``close`` waits for every save submitted."""

    def __init__(self, max_bytes: int = MAX_PENDING_BYTES) -> None:
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, int, Callable[[], None]]] = deque()
        self._pending_bytes = 0
        self._ran: set[str] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvcodec-save", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the saves queued are being written, no new one is taken)."""
        return self._closed

    @property
    def pending_bytes(self) -> int:
        """KV bytes submitted and not yet written."""
        with self._cond:
            return self._pending_bytes

    def submit(self, req_id: str, nbytes: int, save: Callable[[], None]) -> None:
        """Queue ``save`` (request ``req_id``'s, holding ``nbytes`` of KV); waits while the saves waiting hold
        ``max_bytes`` or more (one save larger than that still goes, alone)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the connector's saves are closed")
            while self._pending_bytes and self._pending_bytes + nbytes > self.max_bytes:
                self._cond.wait()
            self._queue.append((req_id, nbytes, save))
            self._pending_bytes += nbytes
            self._cond.notify_all()

    def mark_ran(self, req_id: str) -> None:
        """Count ``req_id``'s save as run without running one (a save skipped)."""
        with self._cond:
            self._ran.add(req_id)

    def take_ran(self) -> set[str]:
        """The requests whose saves have run (or were marked run) since the last call."""
        with self._cond:
            done, self._ran = self._ran, set()
            return done

    def close(self, timeout_s: float | None = None) -> bool:
        """Refuse new saves and wait (up to ``timeout_s``) for those submitted; False if some were still waiting."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                req_id, nbytes, save = self._queue.popleft()
            try:
                save()
            except Exception:  # a save's own failures are logged by it; this only keeps the thread alive
                log.warning("saving request %s failed", req_id, exc_info=True)
            with self._cond:
                self._pending_bytes -= nbytes
                self._ran.add(req_id)
                self._cond.notify_all()


_OPEN: weakref.WeakSet[BackgroundSaves] = weakref.WeakSet()


@atexit.register
def _write_at_exit() -> None:
    for saves in list(_OPEN):
        saves.close()
