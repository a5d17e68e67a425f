"""Storage tiers: byte stores behind one interface (put/get/contains/delete/keys/size).

Values are opaque bytes (single-chunk kvcodec containers); the containers carry their own
checksums, so a tier never has to vouch for its bytes.  Every tier is thread safe.  Tiers
with a byte budget evict least-recently-used values and hand them to ``on_evict``
(the :class:`~kvcodec.store.KVStore` uses it to demote them to the next tier down).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import urllib.parse
from collections import OrderedDict
from typing import Any, Callable, Iterable

from kvcodec.errors import InvalidInputError
from kvcodec.files import atomic_writer

log = logging.getLogger(__name__)

EvictFn = Callable[[str, bytes], None]


class StorageTier:
    """Base class.  Subclasses implement the six operations; none of them raises on a backend fault
    (a tier that cannot answer reports a miss, ``False`` or an empty list instead)."""

    name = "tier"
    capacity_bytes: int | None = None

    def __init__(self) -> None:
        self.on_evict: EvictFn | None = None

    def put(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` (replacing any old value); True when it was stored."""
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> bool:
        raise NotImplementedError

    def keys(self) -> list[str]:
        raise NotImplementedError

    def size(self) -> int:
        """Bytes of the values held."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class MemoryTier(StorageTier):
    """CPU memory, least-recently-used eviction within ``capacity_bytes`` (None: unbounded)."""

    name = "cpu"

    def __init__(self, capacity_bytes: int | None = 1 << 30, *, name: str | None = None) -> None:
        super().__init__()
        if capacity_bytes is not None and capacity_bytes < 0:
            raise InvalidInputError("capacity_bytes must be >= 0 or None")
        self.capacity_bytes = capacity_bytes
        if name:
            self.name = name
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()

    # storage hooks (the GPU tier keeps device tensors instead of bytes)
    def _store(self, value: bytes) -> Any:
        return bytes(value)

    def _load(self, stored: Any) -> bytes:
        return stored

    def _nbytes(self, stored: Any) -> int:
        return len(stored)

    def put(self, key: str, value: bytes) -> bool:
        if self.capacity_bytes is not None and len(value) > self.capacity_bytes:
            return False
        stored = self._store(value)
        evicted = []
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= self._nbytes(old)
            self._items[key] = stored
            self._bytes += self._nbytes(stored)
            while self.capacity_bytes is not None and self._bytes > self.capacity_bytes:
                k, v = self._items.popitem(last=False)
                self._bytes -= self._nbytes(v)
                evicted.append((k, v))
        for k, v in evicted:  # outside the lock: the callback may write to other tiers
            if self.on_evict is not None:
                try:
                    self.on_evict(k, self._load(v))
                except Exception:  # demotion is best effort
                    log.exception("demoting %s from %s failed", k, self.name)
        return True

    def get(self, key: str) -> bytes | None:
        with self._lock:
            stored = self._items.get(key)
            if stored is None:
                return None
            self._items.move_to_end(key)
        return self._load(stored)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def delete(self, key: str) -> bool:
        with self._lock:
            stored = self._items.pop(key, None)
            if stored is None:
                return False
            self._bytes -= self._nbytes(stored)
            return True

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._items)

    def size(self) -> int:
        with self._lock:
            return self._bytes


class GPUTier(MemoryTier):
    """Values kept as uint8 tensors in device memory (LRU within ``capacity_bytes``).

    Needs CUDA (or pass another torch ``device``); a ``get`` copies the bytes back to the host.
    """

    name = "gpu"

    def __init__(self, capacity_bytes: int | None = 1 << 30, *, device: str = "cuda", name: str | None = None) -> None:
        import torch

        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise InvalidInputError("GPUTier needs CUDA, and torch.cuda.is_available() is False")
        super().__init__(capacity_bytes, name=name)
        self.device = torch.device(device)

    def _store(self, value: bytes) -> Any:
        import torch

        host = torch.frombuffer(bytearray(value), dtype=torch.uint8)
        return host.to(self.device, non_blocking=False)

    def _load(self, stored: Any) -> bytes:
        return stored.cpu().numpy().tobytes()

    def _nbytes(self, stored: Any) -> int:
        return int(stored.numel())


class DiskTier(StorageTier):
    """A folder of files, one per key, written atomically.

    A value is written to a temporary file in the same folder (``.tmp-*``), flushed and
    fsynced, then renamed over the final name, and the folder is fsynced: a reader sees
    the old value, the new value, or nothing, never a partial file, even after a kill in
    mid-write.  Temporary files are never served; those older than ``stale_tmp_s`` are
    removed when the tier opens.  ``capacity_bytes`` (None: unbounded) evicts the least
    recently used files, as this process saw them.  Files get the mode a plain ``open()`` would
    give them under the process umask, so other users or services can share the folder.
    """

    name = "disk"
    SUFFIX = ".kvc"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int | None = None, *, name: str | None = None,
                 fsync: bool = True, stale_tmp_s: float = 3600.0) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        if name:
            self.name = name
        os.makedirs(self.path, exist_ok=True)
        self._lock = threading.RLock()
        self._index: OrderedDict[str, int] = OrderedDict()
        now = time.time()
        entries = []
        for entry in os.scandir(self.path):
            if entry.name.startswith(".tmp-"):
                try:
                    if now - entry.stat().st_mtime > stale_tmp_s:
                        os.unlink(entry.path)
                except OSError:
                    pass
            elif entry.name.endswith(self.SUFFIX) and entry.is_file():
                st = entry.stat()
                entries.append((st.st_mtime, self._key(entry.name), st.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size

    def _file(self, key: str) -> str:
        return os.path.join(self.path, urllib.parse.quote(key, safe="@-_") + self.SUFFIX)

    @staticmethod
    def _key(filename: str) -> str:
        return urllib.parse.unquote(filename[: -len(DiskTier.SUFFIX)])

    def put(self, key: str, value: bytes) -> bool:
        if self.capacity_bytes is not None and len(value) > self.capacity_bytes:
            return False
        target = self._file(key)
        try:
            with atomic_writer(target, prefix=".tmp-", fsync=self.fsync) as f:
                f.write(value)
            if self.fsync:
                dfd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError:
            log.warning("disk tier %s: could not write %s", self.path, key, exc_info=True)
            return False
        evicted = []
        with self._lock:
            self._index.pop(key, None)
            self._index[key] = len(value)
            total = sum(self._index.values())
            while self.capacity_bytes is not None and total > self.capacity_bytes and len(self._index) > 1:
                k, n = self._index.popitem(last=False)
                total -= n
                evicted.append(k)
        for k in evicted:
            data = self._read(k)
            self._unlink(k)
            if data is not None and self.on_evict is not None:
                try:
                    self.on_evict(k, data)
                except Exception:
                    log.exception("demoting %s from %s failed", k, self.name)
        return True

    def _read(self, key: str) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except OSError:
            return None

    def _unlink(self, key: str) -> bool:
        try:
            os.unlink(self._file(key))
            return True
        except OSError:
            return False

    def get(self, key: str) -> bytes | None:
        data = self._read(key)
        with self._lock:
            if data is None:
                self._index.pop(key, None)
            else:
                self._index.pop(key, None)
                self._index[key] = len(data)
        return data

    def contains(self, key: str) -> bool:
        return os.path.exists(self._file(key))

    def delete(self, key: str) -> bool:
        with self._lock:
            self._index.pop(key, None)
        return self._unlink(key)

    def keys(self) -> list[str]:
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        return [self._key(n) for n in names if n.endswith(self.SUFFIX) and not n.startswith(".tmp-")]

    def size(self) -> int:
        total = 0
        for k in self.keys():
            try:
                total += os.path.getsize(self._file(k))
            except OSError:
                pass
        return total


# LMCache's Redis layout: "<key>kv_bytes" holds the payload, "<key>metadata" 28 bytes (struct "iiiiiii").
# kvcodec's metadata: format version, payload length, xxh3-64 of the payload (low and high 32 bits), 3 reserved.
META = struct.Struct("<iiiiiii")
META_VERSION = 1


def _meta(value: bytes) -> bytes:
    import xxhash

    h = xxhash.xxh3_64_intdigest(value)
    lo, hi = h & 0xFFFFFFFF, h >> 32
    return META.pack(META_VERSION, len(value), lo - (1 << 32) if lo >= 1 << 31 else lo,
                     hi - (1 << 32) if hi >= 1 << 31 else hi, 0, 0, 0)


class RedisTier(StorageTier):
    """A Redis server (or a ``redis.RedisCluster`` passed as ``client``).

    With a cluster client (or ``hash_tag=True``) the key is wrapped in braces,
    ``{<key>}kv_bytes`` and ``{<key>}metadata``, so that both land in one hash slot.

    Each value is two keys, as LMCache lays them out: ``<key>kv_bytes`` (the container
    chunk) and ``<key>metadata`` (28 bytes: version, payload length, payload xxh3-64),
    written together with one ``MSET`` (atomic: concurrent writers leave one complete
    pair) and read together with one ``MGET``.  Every call has a socket timeout
    (``timeout_s``) and no retries; after a failure the tier reports misses without
    touching the network for ``down_for_s`` seconds, so a dead or hung Redis costs
    at most one timeout per ``down_for_s``.  Nothing raises: faults are misses.
    """

    name = "redis"
    PAYLOAD = "kv_bytes"
    META = "metadata"

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, *, db: int = 0, prefix: str = "",
                 timeout_s: float = 0.2, down_for_s: float = 1.0, client: Any = None, name: str | None = None,
                 ttl_s: int | None = None, hash_tag: bool | None = None) -> None:
        super().__init__()
        if name:
            self.name = name
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.down_for_s = down_for_s
        self.ttl_s = ttl_s
        self._down_until = 0.0
        self.failures = 0
        if client is None:
            try:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry
            except ImportError:
                raise InvalidInputError("RedisTier needs the redis package: pip install 'kvcodec[redis]'") from None
            client = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                                 socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                                 health_check_interval=0)
        self.client = client
        # In a Redis Cluster the two keys of a value must share a hash slot for MSET/MGET: "{<key>}kv_bytes".
        self.hash_tag = "Cluster" in type(client).__name__ if hash_tag is None else hash_tag

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn: Callable[[], Any], default: Any) -> Any:
        if time.monotonic() < self._down_until:
            return default
        try:
            return fn()
        except Exception as e:  # redis.ConnectionError, TimeoutError, ResponseError, ...
            self.failures += 1
            self._down_until = time.monotonic() + self.down_for_s
            log.warning("redis tier %s: %s: %s (treated as a miss for %.1f s)", self.name, type(e).__name__, e,
                        self.down_for_s)
            try:  # drop sockets that may hold half a reply
                self.client.connection_pool.disconnect()
            except Exception:
                pass
            return default

    def _k(self, key: str) -> tuple[str, str]:
        k = self.prefix + ("{" + key + "}" if self.hash_tag else key)
        return k + self.PAYLOAD, k + self.META

    def put(self, key: str, value: bytes) -> bool:
        payload, meta = self._k(key)

        def write() -> bool:
            if self.ttl_s:
                pipe = self.client.pipeline(transaction=True)
                pipe.set(payload, value, ex=self.ttl_s)
                pipe.set(meta, _meta(value), ex=self.ttl_s)
                pipe.execute()
            else:
                self.client.mset({payload: bytes(value), meta: _meta(value)})
            return True

        return bool(self._call(write, False))

    def get(self, key: str) -> bytes | None:
        payload, meta = self._k(key)
        got = self._call(lambda: self.client.mget([payload, meta]), None)
        if not got or got[0] is None or got[1] is None:
            return None
        value, m = got
        if len(m) != META.size or m != _meta(value):
            log.warning("redis tier %s: %s has a payload that does not match its metadata", self.name, key)
            return None
        return value

    def contains(self, key: str) -> bool:
        payload, meta = self._k(key)
        return bool(self._call(lambda: self.client.exists(payload, meta) == 2, False))

    def delete(self, key: str) -> bool:
        payload, meta = self._k(key)
        return bool(self._call(lambda: self.client.delete(payload, meta) > 0, False))

    def keys(self) -> list[str]:
        pattern = self.prefix + "*" + self.META

        def scan() -> list[str]:
            out = []
            for k in self.client.scan_iter(match=pattern, count=1000):
                k = k.decode() if isinstance(k, bytes) else k
                k = k[len(self.prefix): -len(self.META)]
                out.append(k[1:-1] if self.hash_tag and k.startswith("{") and k.endswith("}") else k)
            return out

        return self._call(scan, [])

    def size(self) -> int:
        def total() -> int:
            n = 0
            for k in self.keys():
                got = self.client.get(self._k(k)[1])
                if got is not None and len(got) == META.size:
                    n += META.unpack(got)[1]
            return n

        return self._call(total, 0)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


def tier_names(tiers: Iterable[StorageTier]) -> list[str]:
    return [t.name for t in tiers]
