"""A storage tier over Mooncake Store (``mooncake.store.MooncakeDistributedStore``): a master that keeps metadata
and clients that each mount a segment of their memory, so a chunk put by one process is read by any other.

Install it with ``pip install 'kvcodec[mooncake]'`` (the ``mooncake-transfer-engine-non-cuda`` wheel, which needs
Debian's ``libibverbs1 ibverbs-providers`` even over TCP; ``scripts/setup.sh`` installs both).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import urllib.request
from typing import Any, Callable

import xxhash

from kvcodec.errors import InvalidInputError, LimitExceededError
from kvcodec.store.tiers.base import DEFAULT_MAX_VALUE_BYTES, StorageTier

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 50051  # mooncake_master's own default --rpc_port
DEFAULT_SEGMENT_BYTES = 512 << 20
DEFAULT_BUFFER_BYTES = 128 << 20  # every value passes through it whole: a 256-token 70B fp16 chunk is 80 MiB
DEFAULT_TIMEOUT_S = 2.0
# the client's close takes 1-2 s (measured: 1 s without a segment, 2 s with one) even with a live master
CLOSE_WAIT_S = 5.0

# kvcodec's header before every value: magic, version, payload length, xxh3-64 of the payload.
HEADER = struct.Struct("<4sIQQ")
MAGIC = b"KVMC"
VERSION = 1

# Mooncake's error codes (mooncake-store/include/types.h)
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
# -900..-999 are RPC and transport failures: the master or the network is gone, not the key
RPC_ERRORS = range(-999, -899)


def _header(value: bytes | memoryview) -> bytes:
    return HEADER.pack(MAGIC, VERSION, len(value), xxhash.xxh3_64_intdigest(value))


class MooncakeTier(StorageTier):
    """Mooncake Store through its Python client, one client (and one mounted segment) per tier.

    ``master`` is ``HOST:PORT`` of ``mooncake_master``; ``metadata`` the transfer engine's metadata server
    (``P2PHANDSHAKE``, the default, needs nothing but the master; else an ``http://HOST:PORT/metadata`` URL);
    ``local_hostname`` the address other clients reach this one at (with ``P2PHANDSHAKE`` a bare host: the port
    is picked).  ``segment_bytes`` is the memory this process lends to the store (0: none, it only reads and
    writes others' segments); values live in the segments of the processes that mounted them and vanish with
    them.  ``buffer_bytes`` is this client's transfer buffer: a value larger than it cannot be put or read.
    ``replicas`` copies go to distinct segments (Mooncake silently stores fewer when fewer segments have room:
    :meth:`replica_count` tells).

    Each value is stored as one object, a 24-byte header (magic, version, length, xxh3-64) followed by the
    value, by one ``upsert_parts`` call (so a new value replaces an old one).  Mooncake makes a value readable
    only once its put has completed (the master marks the replica complete at the end of the put), and the
    header's checksum turns any torn or reused buffer a reader might still meet into a miss, so ``get`` returns
    a complete value or None.  A missing key reads as ``b''`` from Mooncake; every stored object has the
    header, so an empty or short read is a miss, never an empty value.

    Every call runs in a worker thread with a deadline of ``timeout_s``: a call past it is a miss, and so are RPC
    failures (a dead master answers after up to 4.5 s); after either, the tier reports misses without calling
    Mooncake for ``down_for_s`` seconds, so a dead or frozen master costs one timeout per ``down_for_s``.
    Mooncake's ``setup`` cannot be bounded that way (it holds the GIL, and blocks 90 s without a master), so the
    client is set up only after the master answered within ``timeout_s`` (its admin ``/health`` when ``admin`` is
    given, else a TCP connect to its port), in the constructor and again on later calls while it has not
    succeeded: a tier built while the master is down misses until it is up.  Without ``admin`` a master that
    accepts connections but never answers (frozen) can still hold the set-up for Mooncake's 90 s.
    ``is_exist`` keeps answering 1 for about 10 s after the process holding a value died: such a ``contains``
    hit is followed by a ``get`` miss.  ``delete`` within a value's 10 s read lease is refused by Mooncake
    (False).  The client cannot list keys: ``keys`` and ``size`` ask the master's HTTP admin server
    (``mooncake_master --metrics_port``) when ``admin`` (``HOST:PORT``) is given, else they return ``[]`` and 0.
    Nothing raises on a backend fault: faults are misses, False, ``[]`` or 0, with a warning.  A value over the
    bound a reader asks for (or ``max_value_bytes``) raises, unfetched.
    """

    name = "mooncake"

    def __init__(self, master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}", *, metadata: str = "P2PHANDSHAKE",
                 local_hostname: str = "127.0.0.1", segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, protocol: str = "tcp", replicas: int = 1,
                 timeout_s: float = DEFAULT_TIMEOUT_S, down_for_s: float = 1.0,
                 prefix: str = "kvcodec:", admin: str | None = None, name: str | None = None,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        super().__init__()
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise InvalidInputError(
                f"MooncakeTier needs Mooncake Store's client: pip install 'kvcodec[mooncake]' (the "
                f"mooncake-transfer-engine-non-cuda wheel) and, on Debian, apt-get install libibverbs1 "
                f"ibverbs-providers (scripts/setup.sh does both); the import failed with: {e}") from None
        if name:
            self.name = name
        for what, v in (("segment_bytes", segment_bytes), ("buffer_bytes", buffer_bytes)):
            if not isinstance(v, int) or v < 0:
                raise InvalidInputError(f"{what} must be a byte count >= 0, not {v!r}")
        if buffer_bytes <= HEADER.size:
            raise InvalidInputError(f"buffer_bytes must exceed {HEADER.size} bytes, not {buffer_bytes}")
        if not isinstance(replicas, int) or replicas < 1:
            raise InvalidInputError(f"replicas must be a whole number >= 1, not {replicas!r}")
        if not timeout_s > 0:
            raise InvalidInputError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
        self.master = master
        self.metadata = metadata
        self.local_hostname = local_hostname
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.protocol = protocol
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.down_for_s = down_for_s
        self.prefix = prefix
        self.admin = admin
        self.max_value_bytes = min(max_value_bytes, buffer_bytes - HEADER.size)
        self.failures = 0
        self._down_until = 0.0
        self._config = ReplicateConfig()
        self._config.replica_num = replicas
        self._client: Any = None
        self._closed = False
        self._setup_lock = threading.Lock()
        self._new_client = MooncakeDistributedStore
        self._connect()

    def _master_answers(self) -> bool:
        """Whether the master is there to set up with, within ``timeout_s``: its admin server's ``/health`` when
        ``admin`` is known (a frozen master fails it), else a TCP connection to its RPC port."""
        try:
            if self.admin is not None:
                with urllib.request.urlopen(f"http://{self.admin}/health", timeout=self.timeout_s) as r:
                    r.read(1024)
            else:
                host, _, port = self.master.rpartition(":")
                socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s).close()
            return True
        except (OSError, ValueError) as e:  # URLError and timeouts are OSErrors
            self._down(f"master {self.master} does not answer ({type(e).__name__}: {e})")
            return False

    def _connect(self) -> Any:
        """The client, set up first if it is not yet.  Mooncake's ``setup`` holds the GIL, so no thread can bound
        it (without a master it blocks 90 s): it runs only once the master answered, and a failed attempt is
        retried after ``down_for_s``."""
        if self._client is not None or self._closed or time.monotonic() < self._down_until:
            return self._client
        if not self._setup_lock.acquire(blocking=False):
            return None  # another thread is setting up
        try:
            if self._client is not None or not self._master_answers():
                return self._client
            client = self._new_client()
            try:
                rc = client.setup(self.local_hostname, self.metadata, self.segment_bytes, self.buffer_bytes,
                                  self.protocol, "", self.master)
            except Exception as e:
                rc = f"{type(e).__name__}: {e}"
            if rc == 0:
                self._client = client
            else:
                self._down(f"set-up with master {self.master} failed ({rc})")
            return self._client
        finally:
            self._setup_lock.release()

    def __repr__(self) -> str:
        return f"MooncakeTier(name={self.name!r}, master={self.master!r}, replicas={self.replicas})"

    @property
    def available(self) -> bool:
        return self._connect() is not None and time.monotonic() >= self._down_until

    def _down(self, why: str) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.down_for_s
        log.warning("mooncake tier %s: %s (treated as a miss for %.1f s)", self.name, why, self.down_for_s)

    def _call(self, what: str, fn: Callable[[Any], Any], default: Any) -> Any:
        """``fn(client)`` in a worker thread within ``timeout_s``; ``default`` when the tier is not ready, down,
        or the call raised or ran out of time.  A call past its deadline keeps its thread until Mooncake returns
        (its own RPC timeout), and the down window keeps new calls from piling up behind it."""
        client = self._connect()
        if client is None or time.monotonic() < self._down_until:
            return default
        box: list[tuple[bool, Any]] = []
        done = threading.Event()

        def work() -> None:
            try:
                box.append((True, fn(client)))
            except Exception as e:
                box.append((False, e))
            finally:
                done.set()

        threading.Thread(target=work, daemon=True, name=f"kvcodec-mooncake-{what}").start()
        if not done.wait(self.timeout_s):
            self._down(f"{what} took more than {self.timeout_s} s")
            return default
        ok, result = box[0]
        if not ok:
            self._down(f"{what} raised {type(result).__name__}: {result}")
            return default
        if isinstance(result, int) and result in RPC_ERRORS:
            self._down(f"{what} failed with Mooncake error {result} (the master or transport is unreachable)")
            return default
        return result

    def _k(self, key: str) -> str:
        return self.prefix + key

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.max_value_bytes:
            log.warning("mooncake tier %s: %s is %d bytes, more than the %d a value may hold (max_value_bytes, "
                        "and buffer_bytes less the header); not stored", self.name, key, len(value),
                        self.max_value_bytes)
            return False
        header = _header(value)
        rc = self._call("put", lambda c: c.upsert_parts(self._k(key), header, value, config=self._config), None)
        if rc is None:
            return False
        if rc != 0:
            log.warning("mooncake tier %s: put of %s failed with Mooncake error %s", self.name, key, rc)
        return rc == 0

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        k = self._k(key)
        limit = min(self.max_value_bytes, self.max_value_bytes if max_bytes is None else max_bytes) + HEADER.size

        def read(c: Any) -> Any:
            n = c.get_size(k)
            if n < 0 or n > limit:
                return n  # a miss or an error code, or a value too large to fetch: nothing is fetched
            return c.get(k)

        got = self._call("get", read, None)
        if got is None:
            return None
        if isinstance(got, int):
            if got < 0:
                if got != OBJECT_NOT_FOUND:
                    log.warning("mooncake tier %s: get_size of %s failed with Mooncake error %d", self.name, key, got)
                return None
            raise LimitExceededError(f"mooncake tier {self.name}: {key} holds {got - HEADER.size} bytes, more than the "
                                     f"{limit - HEADER.size} a read may take")
        if len(got) < HEADER.size:
            # listed but unreadable: the process holding its segment died, or it was removed between the calls
            log.warning("mooncake tier %s: %s is listed but could not be read; treated as a miss", self.name, key)
            return None
        magic, version, n, digest = HEADER.unpack_from(got)
        payload = got[HEADER.size:]
        if magic != MAGIC or version != VERSION or n != len(payload) or xxhash.xxh3_64_intdigest(payload) != digest:
            log.warning("mooncake tier %s: %s does not match its header (not kvcodec's, or torn); treated as a miss",
                        self.name, key)
            return None
        return payload

    def contains(self, key: str) -> bool:
        return self._call("contains", lambda c: c.is_exist(self._k(key)), 0) == 1

    def contains_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        got = self._call("contains", lambda c: c.batch_is_exist([self._k(k) for k in keys]), None)
        return [r == 1 for r in got] if got is not None and len(got) == len(keys) else [False] * len(keys)

    def value_sizes(self, keys: list[str]) -> list[int | None]:
        def ask(c: Any) -> list[int | None]:
            sizes = [c.get_size(self._k(k)) for k in keys]
            return [n - HEADER.size if n >= HEADER.size else None for n in sizes]

        got = self._call("sizes", ask, None) if keys else []
        return got if got is not None else [None] * len(keys)

    def delete(self, key: str) -> bool:
        rc = self._call("delete", lambda c: c.remove(self._k(key)), None)
        if rc == OBJECT_HAS_LEASE:
            log.info("mooncake tier %s: %s was read within its lease (about 10 s); Mooncake keeps it until then",
                     self.name, key)
        elif rc not in (None, 0, OBJECT_NOT_FOUND):
            log.warning("mooncake tier %s: remove of %s failed with Mooncake error %s", self.name, key, rc)
        return rc == 0

    def replica_count(self, key: str) -> int:
        """How many complete copies of ``key`` the master knows of (0 on a miss or a fault)."""
        got = self._call("replicas", lambda c: c.get_replica_desc(self._k(key)), [])
        return sum(1 for r in got if str(r.status).endswith("COMPLETE")) if isinstance(got, list) else 0

    def keys(self) -> list[str]:
        if self.admin is None or self._connect() is None or time.monotonic() < self._down_until:
            return []
        try:
            with urllib.request.urlopen(f"http://{self.admin}/get_all_keys", timeout=self.timeout_s) as r:
                listing = r.read(64 << 20).decode()
        except Exception as e:  # URLError, timeouts, a reset connection
            self._down(f"listing keys at http://{self.admin} failed: {type(e).__name__}: {e}")
            return []
        return [k[len(self.prefix):] for k in listing.split() if k.startswith(self.prefix)]

    def size(self) -> int:
        total = 0
        for key in self.keys():
            n = self._call("size", lambda c, k=self._k(key): c.get_size(k), -1)
            total += max(0, n - HEADER.size)
        return total

    def close(self) -> None:
        """Unmount this client's segment (its values go with it) and disconnect, waiting at most
        ``max(timeout_s, 5 s)``."""
        self._closed = True
        client, self._client = self._client, None
        if client is None:
            return
        t = threading.Thread(target=client.close, daemon=True, name=f"kvcodec-mooncake-close-{self.name}")
        t.start()
        t.join(max(self.timeout_s, CLOSE_WAIT_S))
