"""LMCache plugins through which LMCache users store their KV chunks with kvcodec's codecs.

LMCache moves KV in chunks (256 tokens by default) laid out as one tensor ``[2, L, T, H*D]``
(``MemoryFormat.KV_2LTD``: keys then values, per layer, per token, heads flattened).  Each chunk is
turned into a :class:`~kvcodec.cache.KVCache` with :meth:`KVCache.from_lmcache`, encoded by a kvcodec
codec into a single-chunk container (checksummed, self-describing: shapes, dtype, codec and its
settings travel with it), and back with :meth:`KVCache.to_lmcache`.  Two ways in:

**1. A remote storage connector** (``remote_storage_plugins``, LMCache's ``RemoteConnector`` /
``ConnectorAdapter`` interface).  The compressed chunks go to Redis (LMCache's ``<key>kv_bytes`` /
``<key>metadata`` layout, through :class:`kvcodec.store.RedisTier`), a folder (atomic writes,
:class:`kvcodec.store.DiskTier`) or process memory::

    # lmcache.yaml
    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_url: "kvcodec://127.0.0.1:6379/?backend=redis&codec=cachegen"
    #   or "kvcodec:///var/cache/kvcodec?backend=disk&codec=kivi&bits=4"   (a folder)
    #   or "kvcodec://local/?backend=memory&codec=raw"
    remote_storage_plugins: ["kvcodec"]
    extra_config:
      remote_storage_plugin.kvcodec.module_path: kvcodec.engines.lmcache_plugin
      remote_storage_plugin.kvcodec.class_name: KVCodecConnectorAdapter

   Query parameters other than ``backend``, ``codec``, ``num_heads`` and ``timeout`` are the codec's
   settings (numbers are parsed: ``level=2``, ``bits=4``).  ``num_heads`` defaults to LMCache's
   ``metadata.kv_shape[3]`` (the KV heads of this worker).  A chunk that is missing, damaged
   (checksum) or fails to decode is a miss (``get`` returns None, and it is deleted), so LMCache
   recomputes it; no exception reaches the engine.

**2. A serializer** for LMCache's newer L2 adapters (``register_serde_factory``): call
:func:`register` once (for example from a module your launcher imports), then name it in an
adapter's config::

    import kvcodec.engines.lmcache_plugin as kvp; kvp.register()
    --l2-adapter '{"type": "fs", "base_path": "/var/cache/lmcache",
                   "serde": {"type": "kvcodec", "codec": "cachegen", "num_heads": 8}}'

   The serializer writes the container bytes into LMCache's byte buffer and returns their length;
   the deserializer restores ``[2, L, T, H*D]`` into the destination buffer.

Without LMCache installed, small stand-ins of its base classes (same method names and arguments)
are used, so that the codec path is tested on the CPU (``tests/test_lmcache_plugin.py``).  Neither
plugin has been run inside LMCache here.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

from kvcodec.api import decode, encode
from kvcodec.cache import KVCache
from kvcodec.codecs import Codec, get_codec
from kvcodec.errors import InvalidInputError
from kvcodec.reader import Reader
from kvcodec.store import DiskTier, MemoryTier, RedisTier, StorageTier

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


# --- the chunk codec both plugins use -----------------------------------------------------------

class LMCacheChunkCodec:
    """``[2, L, T, H*D]`` tensors to kvcodec container bytes and back."""

    def __init__(self, codec: str | Codec = "cachegen", *, num_heads: int | None = None, model: str | None = None,
                 **codec_options: Any) -> None:
        self.codec = codec if isinstance(codec, Codec) else get_codec(codec, **codec_options)
        self.num_heads, self.model = num_heads, model

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
    def intact(data: bytes) -> bool:
        """Every checksum of a single-chunk container holds (no decoding)."""
        try:
            with Reader(data) as r:
                r._container.read_frame(0)
            return True
        except Exception:
            return False

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
    """LMCache ``RemoteConnector`` storing each chunk compressed by a kvcodec codec in a kvcodec tier.

    ``local_cpu_backend`` is LMCache's allocator (``allocate(shape, dtype, fmt)`` returning a
    ``MemoryObj`` with a ``.tensor``); ``meta`` (LMCache's engine metadata) gives the chunk shape
    ``kv_shape = (L, 2, chunk_size, H, D)`` and dtype.
    """

    def __init__(self, tier: StorageTier, codec: LMCacheChunkCodec, *, local_cpu_backend: Any = None,
                 loop: asyncio.AbstractEventLoop | None = None, metadata: Any = None) -> None:
        super().__init__()
        self.tier, self.codec, self.local_cpu_backend, self.loop, self.metadata = tier, codec, local_cpu_backend, loop, metadata
        if self.codec.num_heads is None and metadata is not None and getattr(metadata, "kv_shape", None):
            self.codec.num_heads = int(metadata.kv_shape[3])
        self.stats = {"puts": 0, "hits": 0, "misses": 0, "corrupt": 0, "bytes_in": 0, "bytes_out": 0}

    # LMCache calls these -------------------------------------------------------------------------
    async def exists(self, key: Any) -> bool:
        return self.exists_sync(key)

    def exists_sync(self, key: Any) -> bool:
        try:
            return bool(self.tier.contains(_key_str(key)))
        except Exception:
            return False

    async def get(self, key: Any) -> Any:
        return self.get_sync(key)

    def get_sync(self, key: Any) -> Any:
        """The chunk as a freshly allocated LMCache ``MemoryObj``, or None (miss, damaged, undecodable)."""
        k = _key_str(key)
        try:
            data = self.tier.get(k)
        except Exception:
            data = None
        if data is None:
            self.stats["misses"] += 1
            return None
        try:
            chunk = self.codec.decode(data)
        except Exception:
            log.warning("kvcodec chunk %s is damaged or does not decode; deleted (LMCache recomputes it)", k,
                        exc_info=True)
            self.stats["corrupt"] += 1
            self._delete(k)
            return None
        obj = self._allocate(chunk)
        if obj is None:
            return None
        self.stats["hits"] += 1
        self.stats["bytes_in"] += len(data)
        return obj

    async def put(self, key: Any, memory_obj: Any) -> None:
        self.put_sync(key, memory_obj)

    def put_sync(self, key: Any, memory_obj: Any) -> bool:
        try:
            chunk = memory_obj.tensor if hasattr(memory_obj, "tensor") else memory_obj
            if hasattr(memory_obj, "get_shape"):  # a partial chunk keeps its token count in the shape
                chunk = chunk[..., : memory_obj.get_shape()[2], :] if chunk.dim() == 4 else chunk
            data = self.codec.encode(chunk)
            ok = bool(self.tier.put(_key_str(key), data))
            if ok:
                self.stats["puts"] += 1
                self.stats["bytes_out"] += len(data)
            return ok
        except Exception:
            log.warning("encoding or storing chunk %s failed; not stored", _key_str(key), exc_info=True)
            return False
        finally:
            if hasattr(memory_obj, "ref_count_down"):
                memory_obj.ref_count_down()

    async def list(self) -> list[str]:
        return list(self.tier.keys())

    async def close(self) -> None:
        self.tier.close()

    def remove_sync(self, key: Any) -> bool:
        return self._delete(_key_str(key))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any], stop_after_first_not_exits: bool = True) -> list[bool]:
        out, missing = [], False
        for key in keys:
            hit = False if missing else self.exists_sync(key)
            missing = missing or (not hit and stop_after_first_not_exits)
            out.append(hit)
        return out

    def support_ping(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<KVCodecRemoteConnector codec={self.codec.codec.codec_id} tier={self.tier!r}>"

    # helpers --------------------------------------------------------------------------------------
    def _delete(self, key: str) -> bool:
        try:
            return bool(self.tier.delete(key))
        except Exception:
            return False

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


class _TensorObj:
    """A minimal MemoryObj-like holder used when no LMCache allocator is given."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> torch.Size:
        return self.tensor.shape


def connector_from_url(url: str, *, local_cpu_backend: Any = None, loop: Any = None, metadata: Any = None,
                       extra: dict[str, Any] | None = None) -> KVCodecRemoteConnector:
    """``kvcodec://host:port/?backend=redis&codec=cachegen&level=2``, ``kvcodec:///folder?backend=disk`` or
    ``kvcodec://local/?backend=memory``; codec settings from the query and from ``extra``
    (``remote_storage_plugin.kvcodec.codec_options``)."""
    parsed = urlparse(url)
    if parsed.scheme != "kvcodec":
        raise InvalidInputError(f"not a kvcodec:// url: {url!r}")
    q = {k: _parse_value(v[-1]) for k, v in parse_qs(parsed.query).items()}
    backend = str(q.pop("backend", "redis" if parsed.port else "disk" if parsed.path not in ("", "/") else "memory"))
    codec = str(q.pop("codec", "cachegen"))
    num_heads = q.pop("num_heads", None)
    timeout = float(q.pop("timeout", 0.5))
    options = dict((extra or {}).get("remote_storage_plugin.kvcodec.codec_options", {}) or {})
    options.update(q)
    if backend == "redis":
        tier: StorageTier = RedisTier(parsed.hostname or "127.0.0.1", parsed.port or 6379, timeout_s=timeout)
    elif backend == "disk":
        if parsed.path in ("", "/"):
            raise InvalidInputError("backend=disk needs a folder: kvcodec:///path/to/folder?backend=disk")
        tier = DiskTier(parsed.path)
    elif backend == "memory":
        tier = MemoryTier(None)
    else:
        raise InvalidInputError(f"backend must be redis, disk or memory, not {backend!r}")
    model = getattr(metadata, "model_name", None)
    codec_obj = LMCacheChunkCodec(codec, num_heads=int(num_heads) if num_heads else None, model=model, **options)
    return KVCodecRemoteConnector(tier, codec_obj, local_cpu_backend=local_cpu_backend, loop=loop, metadata=metadata)


class KVCodecConnectorAdapter(ConnectorAdapter):
    """The class LMCache instantiates from ``remote_storage_plugin.kvcodec.class_name``; handles ``kvcodec://``."""

    def __init__(self) -> None:
        super().__init__("kvcodec://")

    def create_connector(self, context: Any) -> KVCodecRemoteConnector:
        config = getattr(context, "config", None)
        extra = getattr(config, "extra_config", None) or {}
        return connector_from_url(context.url, local_cpu_backend=getattr(context, "local_cpu_backend", None),
                                  loop=getattr(context, "loop", None), metadata=getattr(context, "metadata", None),
                                  extra=extra)


# --- 2. serializer (register_serde_factory) ---------------------------------------------------

def _tensor(obj: Any) -> torch.Tensor:
    return obj.tensor if hasattr(obj, "tensor") else obj


class KVCodecSerializer(Serializer):
    """LMCache serde ``Serializer``: ``[2, L, T, H*D]`` in ``src``, container bytes written into ``dst``."""

    def __init__(self, codec: LMCacheChunkCodec) -> None:
        self.codec = codec

    def serialize(self, src: Any, dst: Any, key: Any = None) -> int:
        data = self.codec.encode(_tensor(src))
        out = _tensor(dst).view(torch.uint8).reshape(-1)
        if len(data) > out.numel():
            raise InvalidInputError(f"the encoded chunk ({len(data)} bytes) does not fit the {out.numel()}-byte buffer")
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        shapes = getattr(layout_desc, "shapes", None) or [layout_desc]
        dtypes = getattr(layout_desc, "dtypes", None) or [torch.float16]
        return sum(LMCacheChunkCodec.estimate_size(s, d) for s, d in zip(shapes, dtypes))


class KVCodecDeserializer(Deserializer):
    """LMCache serde ``Deserializer``: container bytes in ``src``, ``[2, L, T, H*D]`` restored into ``dst``."""

    def deserialize(self, src: Any, dst: Any, key: Any = None) -> None:
        raw = _tensor(src).reshape(-1).view(torch.uint8)
        chunk = LMCacheChunkCodec.decode(raw.cpu().numpy().tobytes())
        out = _tensor(dst)
        if out.numel() != chunk.numel():
            raise InvalidInputError(f"the chunk holds {tuple(chunk.shape)}, the buffer {tuple(out.shape)}")
        out.copy_(chunk.reshape(out.shape).to(out.dtype))


def make_serde(config: dict[str, Any] | None = None) -> Any:
    """The serde factory: ``{"codec": ..., "num_heads": ..., <codec settings>}``."""
    cfg = dict(config or {})
    cfg.pop("type", None)
    codec = cfg.pop("codec", "cachegen")
    num_heads = cfg.pop("num_heads", None)
    cfg.pop("max_workers", None)
    chunk_codec = LMCacheChunkCodec(codec, num_heads=num_heads, **cfg)
    ser, de = KVCodecSerializer(chunk_codec), KVCodecDeserializer()
    if AsyncSerdeProcessor is not None:  # pragma: no cover - needs LMCache
        return AsyncSerdeProcessor(ser, de)
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
