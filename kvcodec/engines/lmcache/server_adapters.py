"""L2 adapters for LMCache's multiprocess server (``lmcache server``, LMCache 0.5.6) that store each object as
kvcodec's serializer made it, at its real length.

The serializer's output is shorter than the buffer LMCache sizes by ``estimate_serialized_size`` (an upper bound:
that is the point of compressing), and LMCache 0.5.6 loads an object into a buffer of that upper size.  Its own
``fs`` adapter then reports the short file as an ``Incomplete read``, a miss; padding every object to the bound
would keep the bytes on disk at the raw size.  Both adapters here store the real length and accept an object
shorter than its load buffer when that buffer holds serialized bytes (a flat ``uint8`` buffer, the layout
LMCache gives every serde buffer).  They move those bytes and check only their length against the length the
serializer wrote first: a torn object is evicted, with one warning, and counted (``report_status``: ``evicted``),
as kvcodec's own tiers evict a bad value (left, LMCache would read it again on every lookup and log the
deserializer's traceback each time).  Everything else is checked when the serializer reads it
(:mod:`kvcodec.engines.lmcache.serde`: bound to its object key, authenticated, of the buffer's shape), so a value
moved or forged here is a miss there.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig
from lmcache.v1.platform import create_event_notifier

from kvcodec.engines.lmcache.serde import SERIALIZED_LENGTH, object_key_name
from kvcodec.engines.lmcache.settings import adapter_tier_config
from kvcodec.errors import CorruptDataError, LimitExceededError
from kvcodec.store.tiers import redact

log = logging.getLogger(__name__)


def _holds_serialized(obj: Any) -> bool:
    """Whether ``obj`` is a serde buffer (LMCache allocates those as one flat ``uint8`` tensor), which may hold an
    object shorter than itself; a KV buffer must be filled whole."""
    shapes, dtypes = obj.get_shapes(), obj.get_dtypes()
    return len(shapes) == 1 and len(shapes[0]) == 1 and dtypes[0] == torch.uint8


def _fits(obj: Any, n: int, head: bytes) -> bool:
    """Whether an ``n``-byte object starting with ``head`` loads into ``obj``: exactly its size, or shorter into a
    serde buffer (which is then narrowed to ``n``, so what reads it sees the object's bytes only).  Only kvcodec's
    serializer writes objects shorter than their buffers (LMCache's own fill theirs), each starting with the length
    of what follows: one of another length is torn, and raises :class:`CorruptDataError`."""
    size = obj.get_size()
    if n == size:
        return True
    if not (0 < n < size and _holds_serialized(obj)):
        return False
    if n < SERIALIZED_LENGTH.size:
        raise CorruptDataError(f"it holds {n} bytes, too few for a serialized length (torn)")
    (length,) = SERIALIZED_LENGTH.unpack_from(head)
    if SERIALIZED_LENGTH.size + length != n:
        raise CorruptDataError(f"it holds {n} bytes, not the {SERIALIZED_LENGTH.size + length} its serialized "
                               "length says (torn)")
    obj.set_used_size(n)
    return True


# The plugin factory builds the adapter's config from adapter_params with the class named <class_name>Config.
KVCodecFSL2AdapterConfig = FSL2AdapterConfig


class KVCodecFSL2Adapter(FSL2Adapter):
    """LMCache's ``fs`` L2 adapter (same ``adapter_params``: ``base_path``, ``relative_tmp_dir``, ``use_odirect``,
    ...), loading serialized objects at the length they were stored with: each load buffer is narrowed to its
    file's size first (what the upstream ``get_object_sizes()`` hook, not in 0.5.6, is for)."""

    def __init__(self, config: FSL2AdapterConfig, **_: Any) -> None:  # the plugin factory adds l1_memory_desc
        super().__init__(config)
        self.evicted = 0

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        for key, obj in zip(keys, objects, strict=True):
            path = self._key_to_path(key)
            try:  # on the caller's thread: the size must be known before the base adapter reads
                with open(path, "rb", buffering=0) as f:
                    n, head = os.fstat(f.fileno()).st_size, f.read(SERIALIZED_LENGTH.size)
            except OSError:
                continue  # missing: the base adapter reports the miss
            try:
                _fits(obj, n, head)  # a file of any other size stays a miss ("Incomplete read")
            except CorruptDataError as err:  # gone before the base adapter reads it: a clean miss, now and later
                self._evict(key, path, n, err)
        return super().submit_load_task(keys, objects)

    def _evict(self, key: Any, path: Any, n: int, why: Exception) -> None:
        """Remove ``key``'s damaged file (as :meth:`delete` does: LMCache's listeners learn it is gone)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return  # another load evicted it first
        except OSError as err:
            log.warning("kvcodec fs L2 adapter: %s is bad (%s) but could not be evicted (%s); a miss", path, why, err)
            return
        with self._lock:
            self.evicted += 1
        log.warning("kvcodec fs L2 adapter: %s is bad (%s); evicted", path, why)
        self._notify_keys_deleted([key], [n])

    def report_status(self) -> dict:
        return {**super().report_status(), "type": "KVCodecFSL2Adapter", "evicted": self.evicted}


class KVCodecTierL2Adapter(L2AdapterInterface):
    """An LMCache L2 adapter over a kvcodec storage tier; each object is one tier value, of its real length, read
    back at most as long as its load buffer.

    ``adapter_params``: ``url``, a tier URL (:func:`kvcodec.store.tier_from_url`: ``mooncake://`` (Mooncake Store;
    the built-in ``mooncake_store`` L2 type needs a C++ extension the LMCache wheel lacks), ``redis://``,
    ``file://``, ``memory://``; passwords from ``password_file=``/``password_env=``, never in the URL), and
    ``workers``, threads doing the tier's calls (default 2).  Tiers do not lock: an object evicted between lookup
    and load is a load miss, which LMCache recomputes.  Capacity and eviction are the tier's own (a folder's
    ``capacity``, Redis's ``ttl``, Mooncake's eviction), so LMCache's L2 eviction is not wired to it.
    """

    def __init__(self, params: dict[str, Any] | None = None, **_: Any) -> None:
        super().__init__()
        config, own = adapter_tier_config(params)
        self.url = redact(config.tiers[0])
        self.tier = config.make_tiers()[0]
        self._pool = ThreadPoolExecutor(max_workers=own["workers"], thread_name_prefix="kvcodec-l2")
        self._lock = threading.Lock()
        self._next_id = 0
        self.evicted = 0  # bad values deleted by loads (report_status)
        self._store_efd, self._lookup_efd, self._load_efd = (create_event_notifier() for _ in range(3))
        # Completed tasks by id.  These dicts are never replaced, only emptied under the lock: a task finishing
        # while LMCache pops the others must still be found (a lost store never releases its L1 read locks).
        self._stored: dict[int, L2StoreResult] = {}
        self._looked_up: dict[int, Bitmap] = {}
        self._loaded: dict[int, Bitmap] = {}

    def __repr__(self) -> str:
        return f"KVCodecTierL2Adapter({self.tier!r})"

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    def _submit(self, work: Callable[[], Any], results: dict[int, Any], notifier: Any, failed: Callable[[], Any]) -> int:
        """Run ``work`` in the pool; its result (``failed()`` if it raised) goes to ``results`` under a new task id,
        and ``notifier`` fires."""
        with self._lock:
            task_id, self._next_id = self._next_id, self._next_id + 1

        def run() -> None:
            try:
                result = work()
            except Exception:
                log.warning("kvcodec L2 adapter over %s: task %d failed", self.url, task_id, exc_info=True)
                result = failed()
            with self._lock:
                results[task_id] = result
            notifier.notify()

        self._pool.submit(run)
        return task_id

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        def store() -> L2StoreResult:
            stored, sizes = [], []
            for key, obj in zip(keys, objects, strict=True):
                data = bytes(obj.byte_array)  # the serializer's real length: LMCache narrowed the buffer to it
                if self.tier.put(object_key_name(key), data):
                    stored.append(key)
                    sizes.append(len(data))
            if stored:
                self._notify_keys_stored(stored, sizes)
            return L2StoreResult(len(stored) == len(keys), sum(sizes))

        return self._submit(store, self._stored, self._store_efd, lambda: L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done = dict(self._stored)
            self._stored.clear()
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: dict[int, Any]) -> int:
        def lookup() -> Bitmap:
            bitmap = Bitmap(len(keys))
            for i, held in enumerate(self.tier.contains_many([object_key_name(k) for k in keys])):
                if held:
                    bitmap.set(i)
            return bitmap

        return self._submit(lookup, self._looked_up, self._lookup_efd, lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._looked_up.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        return None  # nothing is locked: see the class notes

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        def load() -> Bitmap:
            bitmap = Bitmap(len(keys))
            for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
                name = object_key_name(key)
                try:
                    data = self.tier.get(name, obj.get_size())
                    fits = data is not None and _fits(obj, len(data), data)
                except (CorruptDataError, LimitExceededError) as err:  # can never load into this buffer: gone
                    log.warning("kvcodec L2 adapter over %s: %s is bad (%s); evicted", self.url, name, err)
                    self.tier.delete(name)
                    with self._lock:
                        self.evicted += 1
                    continue
                if data is None:
                    continue
                if not fits:
                    log.warning("kvcodec L2 adapter over %s: %s holds %d bytes, its %d-byte buffer another size; "
                                "a miss", self.url, name, len(data), obj.get_size())
                    continue
                memoryview(obj.byte_array).cast("B")[: len(data)] = data
                bitmap.set(i)
            if bitmap.popcount():
                self._notify_keys_accessed([keys[i] for i in bitmap.get_indices_list()])
            return bitmap

        return self._submit(load, self._loaded, self._load_efd, lambda: Bitmap(len(keys)))

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    def report_status(self) -> dict:
        return {"is_healthy": bool(getattr(self.tier, "available", True)), "type": "KVCodecTierL2Adapter",
                "tier": repr(self.tier), "evicted": self.evicted}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.tier.close()
        for notifier in (self._store_efd, self._lookup_efd, self._load_efd):
            notifier.close()
