"""LMCache plugins through which LMCache users store their KV chunks with kvcodec's codecs.

LMCache moves KV in chunks (256 tokens by default) laid out as one tensor ``[2, L, T, H*D]``
(``MemoryFormat.KV_2LTD``: keys then values, per layer, per token, heads flattened).  Each chunk is
turned into a :class:`~kvcodec.cache.KVCache` with :meth:`KVCache.from_lmcache`, encoded by a kvcodec
codec into a single-chunk container (checksummed, self-describing: shapes, dtype, codec and its
settings travel with it), and back with :meth:`KVCache.to_lmcache`.  Two ways in:

**1. A remote storage connector** (``remote_storage_plugins``, LMCache's ``RemoteConnector`` /
``ConnectorAdapter`` interface) over a :class:`kvcodec.store.KVStore`, as every other engine hook: the store
encodes, keys, checks and decodes each chunk.  The compressed chunks go to Redis (:class:`kvcodec.store.RedisTier`),
a folder (atomic writes, :class:`kvcodec.store.DiskTier`) or process memory, under the store's hash of LMCache's
chunk key (:meth:`KVStore.engine_key`: with the model, codec and its settings, so that LMCache's own Redis connector
never reads them and a codec switch never mixes chunks)::

    # lmcache.yaml
    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_url: "kvcodec://127.0.0.1:6379/?backend=redis&codec=cachegen"
    #   or "kvcodec://:PASSWORD@redis.internal:6379/0?backend=rediss&ssl_ca_certs=/etc/ca.pem&ttl=86400&codec=raw"
    #   or "kvcodec:///var/cache/kvcodec?backend=disk&capacity=20GiB&codec=kivi&bits=4"   (a folder)
    #   or "kvcodec://local/?backend=memory&capacity=2GiB&codec=raw"
    remote_storage_plugins: ["kvcodec"]
    extra_config:
      remote_storage_plugin.kvcodec.module_path: kvcodec.engines.lmcache_plugin
      remote_storage_plugin.kvcodec.class_name: KVCodecConnectorAdapter

   The user name, password, host, port and database, and the tier options of :mod:`kvcodec.store.urls` (Redis:
   ``ttl``, ``timeout``, ``prefix``, ``max_value`` and with ``backend=rediss`` (TLS) ``ssl_ca_certs``,
   ``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``; a folder: ``capacity`` (default
   10 GiB), ``shared``, ``max_value``; memory: ``capacity`` (default 1 GiB)) make the tier, as they would in the
   vLLM connector's ``tiers``.  Query parameters other than those, ``backend``, ``codec``, ``num_heads`` and
   ``workers`` are the codec's settings (numbers are parsed: ``level=2``, ``bits=4``).  ``num_heads`` defaults to LMCache's
   ``metadata.kv_shape[3]`` (the KV heads of this worker).  A chunk is served only once the store has checked it
   (:meth:`KVStore.check_chunk`: every checksum, the key it was written for, the model, and LMCache's ``kv_shape``
   and ``kv_dtype``, bounded before anything is decoded; authenticated under ``$KVCODEC_STORE_SECRET``).  A chunk
   that is missing, bad or fails to decode is a miss (``get`` returns None; a bad one is deleted), so LMCache
   recomputes it; no exception reaches the engine.  With ``codec=kvtc`` the calibration is found by
   LMCache's ``model_name`` (and stored once beside the chunks, for other machines); when none is installed, the
   plugin loads that model (a folder, a GGUF file or ``smollm2``) with transformers on the CPU and calibrates it
   once at start-up, saying so in the log
   (``calibrate.max_tokens=4096`` and other ``calibrate.*`` parameters set the calibration).

**2. A serializer** for the L2 adapters of LMCache's multiprocess server (``register_serde_factory``):
:func:`register` registers it, and :mod:`kvcodec.engines.lmcache_server` does so when the server imports it for
one of its plugin L2 adapters, which store the serialized chunk at its real length (LMCache's own ``fs`` adapter
reads a shorter object back as an incomplete read, a miss)::

    --l2-adapter '{"type": "plugin", "module_path": "kvcodec.engines.lmcache_server",
                   "class_name": "KVCodecFSL2Adapter", "adapter_params": {"base_path": "/var/cache/lmcache"},
                   "serde": {"type": "kvcodec", "codec": "cachegen", "num_heads": 8}}'

   The serializer writes the container bytes into LMCache's byte buffer and returns their length;
   the deserializer restores ``[2, L, T, H*D]`` into the destination buffer.

Without LMCache installed, small stand-ins of its base classes (same method names and arguments)
are used, so that the codec path is tested on the CPU (``tests/test_lmcache_plugin.py``).  Both run inside the
real LMCache in ``tests/engines/`` (``test_lmcache.py``; the serializer in a real ``lmcache server`` in
``test_lmcache_server.py``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import torch

from kvcodec.api import decode, encode
from kvcodec.cache import KVCache
from kvcodec.codecs import Codec, get_codec
from kvcodec.engines.auto_calibration import ensure_model_calibration, load_served_model, wants_calibration
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.reader import Reader
from kvcodec.store import DEFAULT_STORE_CHUNK_TOKENS, ChunkShape, KVStore, StorageTier, format_key
from kvcodec.store.auth import secret_from_env
from kvcodec.store.urls import OPTIONS as TIER_OPTIONS
from kvcodec.store.urls import redact, tier_from_url

log = logging.getLogger(__name__)

try:  # pragma: no cover - LMCache is not installed in the CPU test environment
    from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext  # noqa: F401
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
    HAVE_LMCACHE = True
except Exception:
    HAVE_LMCACHE = False

    class ConnectorAdapter(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for LMCache's ``ConnectorAdapter``."""

        def __init__(self, schema: str = "") -> None:
            self.schema = schema

        def can_parse(self, url: str) -> bool:
            return self.schema != "" and url.startswith(self.schema)

        @abc.abstractmethod
        def create_connector(self, context: Any) -> Any: ...

    class RemoteConnector(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for LMCache's ``RemoteConnector`` (the methods LMCache calls)."""

        def post_init(self) -> None:
            return None

try:  # pragma: no cover
    from lmcache.v1.distributed.serde import (
        AsyncSerdeProcessor,
        Deserializer,
        Serializer,
        register_serde_factory,
    )
    HAVE_LMCACHE_SERDE = True
except Exception:
    HAVE_LMCACHE_SERDE = False
    AsyncSerdeProcessor = None  # type: ignore[assignment,misc]
    register_serde_factory = None  # type: ignore[assignment]

    class Serializer(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for LMCache's serde ``Serializer``."""

    class Deserializer(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for LMCache's serde ``Deserializer``."""


MAGIC_OVERHEAD = 1 << 16  # header, index and tables beyond the element bytes (an upper bound for the estimate)
KEY_CONTEXT = b"lmcache-chunk/1\0"  # keeps LMCache's chunk keys apart from other engines' names (KVStore.engine_key)
UNNAMED_MODEL = "unnamed"  # the store's model name when LMCache gives none


# --- the chunk codec the serializer uses ------------------------------------------------------------

def prepare_model(codec: str | Codec, codec_options: dict[str, Any], model: str | None,
                  calibration_options: dict[str, Any] | None) -> None:
    """kvtc: calibrate ``model`` (LMCache's ``model_name``) once, now, when no calibration of it is installed."""
    if model and wants_calibration(codec, codec_options):
        ensure_model_calibration(model, lambda: load_served_model(model, log.info), log.info, calibration_options)


class LMCacheChunkCodec:
    """``[2, L, T, H*D]`` tensors to kvcodec container bytes and back."""

    def __init__(self, codec: str | Codec = "cachegen", *, num_heads: int | None = None, model: str | None = None,
                 calibration_options: dict[str, Any] | None = None, **codec_options: Any) -> None:
        self.codec = codec if isinstance(codec, Codec) else get_codec(codec, **codec_options)
        self.num_heads, self.model = num_heads, model
        prepare_model(codec, codec_options, model, calibration_options)

    def encode(self, chunk: torch.Tensor, num_heads: int | None = None) -> bytes:
        h = num_heads or self.num_heads
        if not h:
            raise InvalidInputError("the number of KV heads is needed to split [2, L, T, H*D]")
        kv = KVCache.from_lmcache(chunk.detach().cpu(), int(h), model=self.model)
        return encode(kv, self.codec, chunk_tokens=max(1, chunk.shape[2]))

    @staticmethod
    def decode(data: bytes | bytearray | memoryview, *, device: Any = None) -> torch.Tensor:
        """The ``[2, L, T, H*D]`` chunk of ``data`` (raises on damaged or undecodable data)."""
        return decode(bytes(data), device=device).to_lmcache()

    @staticmethod
    def estimate_size(shape: Any, dtype: torch.dtype) -> int:
        """An upper bound of the encoded size of a chunk (no codec expands beyond its raw bytes much)."""
        n = 1
        for s in shape:
            n *= int(s)
        return n * torch.empty((), dtype=dtype).element_size() + MAGIC_OVERHEAD + 16 * int(shape[2] if len(shape) > 2 else 0)


def _parse_value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def _key_str(key: Any) -> str:
    for attr in ("to_string", "to_str"):
        fn = getattr(key, attr, None)
        if callable(fn):
            return str(fn())
    return str(key)


# --- 1. remote storage connector ---------------------------------------------------------------

class KVCodecRemoteConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over a kvcodec :class:`KVStore`: each chunk is stored, checked and loaded by the
    store (:meth:`KVStore.put_chunk`, :meth:`KVStore.load_chunk`) under :meth:`KVStore.engine_key` of LMCache's
    chunk key, which chains the prefix already.

    ``num_heads`` splits LMCache's ``[2, L, T, H*D]``; ``local_cpu_backend`` is LMCache's allocator
    (``allocate(shape, dtype, fmt)`` returning a ``MemoryObj`` with a ``.tensor``).  The async methods LMCache awaits
    on its event loop run the store's work (round trips, file I/O, encoding, decoding) in a small thread pool of
    their own, so that loop never blocks on them.
    """

    def __init__(self, store: KVStore, num_heads: int | None, *, local_cpu_backend: Any = None,
                 loop: asyncio.AbstractEventLoop | None = None, metadata: Any = None, config: Any = None,
                 max_workers: int = 2) -> None:
        if HAVE_LMCACHE and config is not None and metadata is not None:
            super().__init__(config, metadata)  # LMCache's RemoteConnector(config, metadata): chunk sizes, formats
        self.store, self.num_heads = store, num_heads
        self.local_cpu_backend, self.loop, self.metadata = local_cpu_backend, loop, metadata
        self.bytes_out = 0
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvcodec-lmcache")

    @property
    def stats(self) -> dict[str, int]:
        """The store's counters (``hits``: chunks read intact, ``misses``, ``corrupt``, ``puts``, ...) and
        ``bytes_out``, the bytes of the values stored."""
        return {**self.store.stats, "bytes_out": self.bytes_out}

    @property
    def tier(self) -> StorageTier:
        """The tier the URL names (the store's only one)."""
        return self.store.tiers[0]

    def key(self, key: Any) -> str:
        """The tier key of LMCache's chunk ``key``."""
        return self.store.engine_key(_key_str(key), KEY_CONTEXT)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # LMCache calls these -------------------------------------------------------------------------
    async def exists(self, key: Any) -> bool:
        return await self._off_loop(self.exists_sync, key)

    def exists_sync(self, key: Any) -> bool:
        return self.batched_contains([key]) == 1

    # LMCache's memory objects are only touched on its event loop (a copy in, a copy out): LMCache frees its memory
    # pool when it shuts down, also while a thread of ours might still be reading a chunk.
    async def get(self, key: Any) -> Any:
        chunk = await self._off_loop(self._fetch, key)
        return self._deliver(chunk)

    def get_sync(self, key: Any) -> Any:
        """The chunk as a freshly allocated LMCache ``MemoryObj``, or None (a miss: missing, damaged, not of this
        engine's shape, or undecodable here; the store evicts what is bad)."""
        return self._deliver(self._fetch(key))

    def _fetch(self, key: Any) -> torch.Tensor | None:
        kv = self.store.load_chunk(self.key(key))
        return None if kv is None else kv.to_lmcache()

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._off_loop(self._store, key, _chunk_of(memory_obj).clone())

    def put_sync(self, key: Any, memory_obj: Any) -> bool:
        """Encode and store the chunk.  The memory object stays the caller's: LMCache's wrapper around every
        remote connector releases it after ``put`` returns."""
        return self._store(key, _chunk_of(memory_obj))

    def _store(self, key: Any, chunk: torch.Tensor) -> bool:
        try:
            if not self.num_heads:
                raise InvalidInputError("the number of KV heads is needed to split [2, L, T, H*D]")
            size = self.store.put_chunk(self.key(key), KVCache.from_lmcache(chunk.detach().cpu(), int(self.num_heads),
                                                                             model=self.store.model))
            self.bytes_out += size
            return size > 0 or self.exists_sync(key)  # nothing written: stored already, or a fault
        except Exception:
            log.warning("encoding or storing chunk %s failed; not stored", _key_str(key), exc_info=True)
            return False

    async def list(self) -> list[str]:
        """The tier keys of this store's chunks (kvcodec's hashed names: LMCache's own keys are not kept)."""
        return await self._off_loop(self._keys)

    def _keys(self) -> list[str]:
        prefix = format_key(self.store.model, b"", self.store.identity.namespace)
        return sorted({k for t in self.store.tiers for k in KVStore.call_tier(t, "keys", default=[])
                       if k.startswith(prefix)})

    async def close(self) -> None:
        """Finish the puts and gets in flight first: they read and write LMCache's memory objects, which LMCache
        frees once its backends are closed."""
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self.store.close()

    def remove_sync(self, key: Any) -> bool:
        k = self.key(key)
        return any([bool(KVStore.call_tier(t, "delete", k, default=False)) for t in self.store.tiers])

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many of ``keys``, from the first, are stored (LMCache's prefix hit, in chunks): one batch question
        per tier."""
        return self.store.held_prefix([self.key(k) for k in keys])

    def support_ping(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<KVCodecRemoteConnector codec={self.store.codec!r} tiers={[t.name for t in self.store.tiers]}>"

    # helpers --------------------------------------------------------------------------------------
    def _deliver(self, chunk: torch.Tensor | None) -> Any:
        return None if chunk is None else self._allocate(chunk)

    def _allocate(self, chunk: torch.Tensor) -> Any:
        backend = self.local_cpu_backend
        if backend is None:
            return _TensorObj(chunk)
        fmt = None
        try:
            from lmcache.v1.memory_management import MemoryFormat  # pragma: no cover
            fmt = MemoryFormat.KV_2LTD  # pragma: no cover
        except Exception:
            pass
        try:
            obj = backend.allocate(chunk.shape, chunk.dtype, fmt) if fmt is not None else backend.allocate(chunk.shape, chunk.dtype)
        except Exception:
            log.warning("LMCache could not allocate a %s buffer", tuple(chunk.shape), exc_info=True)
            return None
        if obj is None:
            return None
        obj.tensor.copy_(chunk.to(obj.tensor.dtype))
        return obj


def _chunk_of(memory_obj: Any) -> torch.Tensor:
    """The ``[2, L, T, H*D]`` tensor of an LMCache memory object (a partial chunk keeps its token count in the
    object's shape) or of a bare tensor."""
    chunk = memory_obj.tensor if hasattr(memory_obj, "tensor") else memory_obj
    if hasattr(memory_obj, "get_shape") and chunk.dim() == 4:
        chunk = chunk[..., : memory_obj.get_shape()[2], :]
    return chunk


class _TensorObj:
    """A minimal MemoryObj-like holder used when no LMCache allocator is given."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> torch.Size:
        return self.tensor.shape


def connector_from_url(url: str, *, local_cpu_backend: Any = None, loop: Any = None, metadata: Any = None,
                       extra: dict[str, Any] | None = None, config: Any = None,
                       plugin: str = "kvcodec") -> KVCodecRemoteConnector:
    """``kvcodec://[[user]:password@]host:port[/db]?backend=redis&codec=cachegen&level=2`` (``backend=rediss``: TLS),
    ``kvcodec:///folder?backend=disk`` or ``kvcodec://local/?backend=memory``.  The tier's own options
    (:mod:`kvcodec.store.urls`: ``ttl``, ``timeout``, ``prefix``, ``ssl_*`` for Redis, ``capacity``, ``shared`` for a
    folder, ``capacity`` for memory, ``max_value``) are taken out of the query; the rest, and ``extra``'s
    ``remote_storage_plugin.<plugin>.codec_options``, are codec settings.  ``workers`` (default 2) threads do the
    storage and codec work off LMCache's event loop.  With ``codec=kvtc`` and no ``calibration``, a model (LMCache's
    ``model_name``: a folder, GGUF file or ``smollm2``) with no calibration installed is calibrated once, at
    start-up; ``calibrate.<option>=value`` settings (``calibrate.max_tokens=4096``) are kvtc calibrate's."""
    parsed = urlsplit(url)
    if parsed.scheme != "kvcodec":
        raise InvalidInputError(f"not a kvcodec:// url: {redact(url)!r}")
    raw = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    try:
        port = parsed.port
    except ValueError:
        raise InvalidInputError(f"{redact(url)!r}: the port is not a number from 1 to 65535") from None
    backend = raw.pop("backend", "redis" if port else "disk" if parsed.path not in ("", "/") else "memory")
    kind = {"redis": "redis", "rediss": "rediss", "disk": "disk", "memory": "memory"}.get(backend)
    if kind is None:
        raise InvalidInputError(f"backend must be redis, rediss, disk or memory, not {backend!r}")
    tier_query = urlencode({k: raw.pop(k) for k in list(raw) if k in TIER_OPTIONS[kind]})
    if kind in ("redis", "rediss"):
        tier_url = f"{kind}://{parsed.netloc or '127.0.0.1'}{parsed.path}?{tier_query}"
    elif kind == "disk":
        if parsed.path in ("", "/"):
            raise InvalidInputError("backend=disk needs a folder: kvcodec:///path/to/folder?backend=disk")
        tier_url = f"file://{parsed.path}?{tier_query}"
    else:
        tier_url = f"memory://?{tier_query}"
    tier = tier_from_url(tier_url)
    q = {k: _parse_value(v) for k, v in raw.items()}
    codec = str(q.pop("codec", "cachegen"))
    num_heads = q.pop("num_heads", None)
    workers = int(q.pop("workers", 2))
    calibration = {k.removeprefix("calibrate."): q.pop(k) for k in list(q) if k.startswith("calibrate.")}
    options = dict((extra or {}).get(f"remote_storage_plugin.{plugin}.codec_options", {}) or {})
    options.update(q)
    model = getattr(metadata, "model_name", None)
    prepare_model(codec, options, model, calibration)
    kv_shape = getattr(metadata, "kv_shape", None)
    if num_heads is None and kv_shape:
        num_heads = kv_shape[3]
    store = KVStore([tier], model=model or UNNAMED_MODEL, codec=get_codec(codec, **options), secret=secret_from_env(),
                    chunk_tokens=int(kv_shape[2]) if kv_shape else DEFAULT_STORE_CHUNK_TOKENS,
                    shape=_engine_shape(metadata))
    return KVCodecRemoteConnector(store, int(num_heads) if num_heads else None, local_cpu_backend=local_cpu_backend,
                                  loop=loop, metadata=metadata, config=config, max_workers=workers)


def _engine_shape(metadata: Any) -> ChunkShape | None:
    """What LMCache's engine holds (``kv_shape`` ``(L, 2, chunk_size, H, D)`` and ``kv_dtype``): chunks of any other
    shape are corrupt, and every decode is bounded by it.  None without metadata (the store's byte bound then)."""
    kv_shape, dtype = getattr(metadata, "kv_shape", None), getattr(metadata, "kv_dtype", None)
    if not kv_shape or not isinstance(dtype, torch.dtype):
        return None
    layers, _, _, heads, dim = (int(x) for x in kv_shape)
    return ChunkShape(layers, heads, dim, dim, str(dtype).removeprefix("torch."))


class KVCodecConnectorAdapter(ConnectorAdapter):
    """The class LMCache instantiates from ``remote_storage_plugin.<name>.class_name``.

    It takes the backend ``remote_storage_plugins: ["kvcodec"]`` makes (URL ``plugin://kvcodec``, or
    ``plugin://kvcodec.<instance>``), whose settings are the URL in ``remote_storage_plugin.<name>.url``, and a
    legacy ``remote_url: "kvcodec://..."``."""

    def __init__(self) -> None:
        super().__init__("kvcodec://")

    def can_parse(self, url: str) -> bool:
        return url.startswith("kvcodec://") or (url.startswith("plugin://") and
                                                url[len("plugin://"):].split(".", 1)[0] == "kvcodec")

    def create_connector(self, context: Any) -> KVCodecRemoteConnector:
        config = getattr(context, "config", None)
        extra = getattr(config, "extra_config", None) or {}
        url, plugin = context.url, "kvcodec"
        if url.startswith("plugin://"):
            plugin = getattr(context, "plugin_name", None) or url[len("plugin://"):]
            url = extra.get(f"remote_storage_plugin.{plugin}.url")
            if not url:
                raise InvalidInputError(f"remote_storage_plugins names {plugin!r}: set extra_config "
                                        f"remote_storage_plugin.{plugin}.url to a kvcodec:// URL")
        return connector_from_url(url, local_cpu_backend=getattr(context, "local_cpu_backend", None),
                                  loop=getattr(context, "loop", None), metadata=getattr(context, "metadata", None),
                                  extra=extra, config=config, plugin=plugin)


# --- 2. serializer (register_serde_factory) ---------------------------------------------------

def _tensor(obj: Any) -> torch.Tensor:
    return obj.tensor if hasattr(obj, "tensor") else obj


# A serialized chunk is its container's length (8 bytes, little-endian) and then the container: LMCache loads it
# into a buffer sized by estimate_serialized_size, so bytes of no meaning follow it there.
SERIALIZED_LENGTH = struct.Struct("<Q")


class KVCodecSerializer(Serializer):
    """LMCache serde ``Serializer``: ``[2, L, T, H*D]`` in ``src``, its length-prefixed container written into
    ``dst``."""

    def __init__(self, codec: LMCacheChunkCodec) -> None:
        self.codec = codec

    def serialize(self, src: Any, dst: Any, key: Any = None) -> int:
        container = self.codec.encode(_tensor(src))
        data = SERIALIZED_LENGTH.pack(len(container)) + container
        out = _tensor(dst).view(torch.uint8).reshape(-1)
        if len(data) > out.numel():
            raise InvalidInputError(f"the encoded chunk ({len(data)} bytes) does not fit the {out.numel()}-byte buffer")
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        shapes = getattr(layout_desc, "shapes", None) or [layout_desc]
        dtypes = getattr(layout_desc, "dtypes", None) or [torch.float16]
        return SERIALIZED_LENGTH.size + sum(LMCacheChunkCodec.estimate_size(s, d) for s, d in zip(shapes, dtypes))


class KVCodecDeserializer(Deserializer):
    """LMCache serde ``Deserializer``: a length-prefixed container at the start of ``src`` (whatever follows it),
    ``[2, L, T, H*D]`` restored into ``dst``."""

    def deserialize(self, src: Any, dst: Any, key: Any = None) -> None:
        raw = _tensor(src).reshape(-1).view(torch.uint8).cpu().numpy()
        if raw.size < SERIALIZED_LENGTH.size:
            raise CorruptDataError(f"a {raw.size}-byte buffer is too short for a serialized kvcodec chunk")
        (n,) = SERIALIZED_LENGTH.unpack(raw[: SERIALIZED_LENGTH.size].tobytes())
        if n > raw.size - SERIALIZED_LENGTH.size:
            raise CorruptDataError(f"the serialized chunk claims {n} bytes; its {raw.size}-byte buffer holds fewer")
        out = _tensor(dst)
        with Reader(raw[SERIALIZED_LENGTH.size: SERIALIZED_LENGTH.size + n].tobytes(), out.numel() * 4) as r:
            chunk = r.decode().to_lmcache()  # bounded by the buffer's elements (up to float32) before decoding
        if tuple(chunk.shape) != tuple(out.shape):
            raise CorruptDataError(f"the chunk holds {tuple(chunk.shape)}, the buffer {tuple(out.shape)}")
        out.copy_(chunk.to(out.dtype))


def make_serde(config: dict[str, Any] | None = None) -> Any:
    """The serde factory: ``{"codec": ..., "num_heads": ..., "max_workers": ..., "model": ...,
    "calibration_options": {...}, <codec settings>}`` (``max_workers``: threads of LMCache's
    ``AsyncSerdeProcessor``, default 1; ``model`` names the caches' model, which kvtc's calibration is found by,
    and calibrated with ``calibration_options`` when none is installed)."""
    cfg = dict(config or {})
    cfg.pop("type", None)
    codec = cfg.pop("codec", "cachegen")
    num_heads = cfg.pop("num_heads", None)
    max_workers = int(cfg.pop("max_workers", 1))
    chunk_codec = LMCacheChunkCodec(codec, num_heads=num_heads, model=cfg.pop("model", None),
                                    calibration_options=cfg.pop("calibration_options", None), **cfg)
    ser, de = KVCodecSerializer(chunk_codec), KVCodecDeserializer()
    if AsyncSerdeProcessor is not None:  # pragma: no cover - needs LMCache
        return AsyncSerdeProcessor(ser, de, max_workers=max_workers)
    return ser, de


def register(name: str = "kvcodec") -> bool:
    """Register the serializer with LMCache (``register_serde_factory``); False when LMCache is missing."""
    if register_serde_factory is None:
        return False
    try:  # pragma: no cover - needs LMCache
        register_serde_factory(name, make_serde)
        return True
    except Exception:  # pragma: no cover - already registered
        log.info("serde %s already registered", name, exc_info=True)
        return True
