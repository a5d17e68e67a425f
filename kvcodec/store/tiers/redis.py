"""A tier on a Redis server or cluster (:class:`RedisTier`)."""

from __future__ import annotations

import logging
import re
import struct
import time
from typing import Any, Callable

from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.store.tiers.base import DEFAULT_MAX_VALUE_BYTES, StorageTier, check_size

log = logging.getLogger(__name__)


# kvcodec's metadata value: format version, payload length, xxh3-64 of the payload (low and high 32 bits), 3 reserved.
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

    Each value is two keys, ``<prefix><key>:data`` (the container chunk) and ``<prefix><key>:meta`` (28 bytes:
    version, payload length, payload xxh3-64), written together with one ``MSET`` (atomic: concurrent writers leave
    one complete pair; with ``ttl_s`` a ``MULTI`` of two ``SET ... EX``) and read together by one ``MULTI`` of
    ``STRLEN``, ``GETRANGE`` up to the bound and ``GET`` (one round trip, a consistent pair): a value larger than
    ``max_value_bytes`` or the bound its reader asks for raises, and no more than that is ever sent or allocated for
    it; so does a payload that disagrees with its metadata (the reader evicts both).  The
    names are kvcodec's own (default prefix ``kvcodec:``): LMCache's own Redis connector writes ``<key>kv_bytes`` and
    ``<key>metadata`` with another metadata format, and the two never read each other's values from a shared
    database.  With a cluster client (or ``hash_tag=True``) the key is wrapped in braces, ``{<key>}:data``, so
    that both land in one hash slot.

    ``username`` / ``password`` authenticate (AUTH / ACL); ``ssl=True`` speaks TLS, with ``ssl_options`` passed on
    to redis-py (``ssl_ca_certs``, ``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile``, ...).  The password is
    never logged nor shown in the repr.  Every call has a socket timeout (``timeout_s``) and no retries; after a
    failure the tier reports misses without touching the network for ``down_for_s`` seconds, so a dead or hung
    Redis costs at most one timeout per ``down_for_s``.  No backend fault raises: faults are misses.
    """

    name = "redis"
    PAYLOAD = ":data"
    META = ":meta"

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, *, db: int = 0, prefix: str = "kvcodec:",
                 timeout_s: float = 0.2, down_for_s: float = 1.0, client: Any = None, name: str | None = None,
                 ttl_s: int | None = None, hash_tag: bool | None = None, username: str | None = None,
                 password: str | None = None, ssl: bool = False, ssl_options: dict[str, Any] | None = None,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        super().__init__()
        if name:
            self.name = name
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidInputError(f"ttl_s must be a positive number of seconds or None, not {ttl_s}")
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.down_for_s = down_for_s
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self._down_until = 0.0
        self.failures = 0
        if client is None:
            try:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry
            except ImportError:
                raise InvalidInputError("RedisTier needs the redis package: pip install 'kvcodec[redis]'") from None
            tls = {"ssl": True, **(ssl_options or {})} if ssl else {}
            client = redis.Redis(host=host, port=port, db=db, username=username, password=password,
                                 socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 retry=Retry(NoBackoff(), 0), health_check_interval=0, **tls)
            where = f"{'rediss' if ssl else 'redis'}://{username + '@' if username else ''}{host}:{port}/{db}"
        else:
            where = type(client).__name__
        self._where = where
        self.client = client
        # In a Redis Cluster the two keys of a value must share a hash slot for MSET and MULTI: "{<key>}:data".
        self.hash_tag = "Cluster" in type(client).__name__ if hash_tag is None else hash_tag

    def __repr__(self) -> str:
        return f"RedisTier(name={self.name!r}, at={self._where!r}, prefix={self.prefix!r})"

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
        if len(value) > self.max_value_bytes:
            return False
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

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        payload, meta = self._k(key)
        limit = min(self.max_value_bytes, self.max_value_bytes if max_bytes is None else max_bytes)

        # A Lua script could check the length before sending anything, but it copies the value through Lua: measured
        # 1.8-2.2x slower than GET on 1-8 MB values.  GETRANGE bounds what an oversized value costs instead.
        def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=True)
            pipe.strlen(payload)
            pipe.getrange(payload, 0, max(0, limit - 1))
            pipe.get(meta)
            return pipe.execute()

        got = self._call(read, None)
        if not got or got[2] is None:
            return None
        n, value, m = got
        check_size(self, key, n, limit)
        if len(m) != META.size or m != _meta(value):
            raise CorruptDataError(f"redis tier {self.name}: {key} has a payload that does not match its metadata")
        return value

    def contains(self, key: str) -> bool:
        payload, meta = self._k(key)
        return bool(self._call(lambda: self.client.exists(payload, meta) == 2, False))

    def contains_many(self, keys: list[str]) -> list[bool]:
        def ask() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(*self._k(key))
            return [n == 2 for n in pipe.execute()]

        return self._call(ask, [False] * len(keys)) if keys else []

    def value_sizes(self, keys: list[str]) -> list[int | None]:
        def ask() -> list[int | None]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                payload, meta = self._k(key)
                pipe.strlen(payload)
                pipe.exists(meta)
            got = pipe.execute()
            return [n if held else None for n, held in zip(got[::2], got[1::2])]

        return self._call(ask, [None] * len(keys)) if keys else []

    ranged_reads = True

    def get_range(self, key: str, offset: int, length: int, max_bytes: int | None = None) -> bytes | None:
        payload, _ = self._k(key)
        limit = min(self.max_value_bytes, self.max_value_bytes if max_bytes is None else max_bytes)
        length = max(0, min(length, limit - offset))

        def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=True)
            pipe.exists(payload)
            pipe.getrange(payload, offset, offset + length - 1)
            return pipe.execute()

        got = self._call(read, None) if length else None
        return None if not got or not got[0] else bytes(got[1])

    def delete(self, key: str) -> bool:
        payload, meta = self._k(key)
        return bool(self._call(lambda: self.client.delete(payload, meta) > 0, False))

    def keys(self) -> list[str]:
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "*" + self.META

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
