"""LMCache's remote storage plugin (``remote_storage_plugins``; LMCache's ``RemoteConnector``/``ConnectorAdapter``
interface) over a :class:`kvcodec.store.KVStore`: the store encodes, keys, checks and decodes each chunk.

Without LMCache installed, small stand-ins of its base classes (same method names and arguments) are used, so that
``tests/test_lmcache_plugin.py`` runs on the CPU; ``tests/engines/test_lmcache.py`` runs it inside LMCache.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvcodec.cache import KVCache
from kvcodec.engines.lmcache.settings import open_lmcache_store, url_config
from kvcodec.errors import InvalidInputError
from kvcodec.store import ChunkShape, KVStore, StorageTier

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

KEY_CONTEXT = b"lmcache-chunk/1\0"  # keeps LMCache's chunk keys apart from other engines' names (KVStore.engine_key)


def _key_str(key: Any) -> str:
    for attr in ("to_string", "to_str"):
        fn = getattr(key, attr, None)
        if callable(fn):
            return str(fn())
    return str(key)


class KVCodecRemoteConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over a kvcodec :class:`KVStore`: each chunk is stored, checked and loaded by the
    store (:meth:`KVStore.put_chunk`, :meth:`KVStore.load_chunk`) under :meth:`KVStore.engine_key` of LMCache's
    chunk key, which chains the prefix already.  A store of several variants keeps each chunk in all of them and
    loads each in the one that restores soonest by its estimates (LMCache asks for one chunk at a time).

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
        return self.store.holds_chunk(self.key(key))

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
        return await self._off_loop(lambda: sorted(self.store.keys()))

    async def close(self) -> None:
        """Finish the puts and gets in flight first: they read and write LMCache's memory objects, which LMCache
        frees once its backends are closed."""
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self.store.close()

    def remove_sync(self, key: Any) -> bool:
        return self.store.delete(self.key(key))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many of ``keys``, from the first, are stored whole (LMCache's prefix hit, in chunks): one batch
        question per tier, then each value's last bytes (a torn value is evicted, so LMCache never plans its load)."""
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
    """The connector of ``url`` (:func:`kvcodec.engines.lmcache.settings.url_config`; ``extra``'s
    ``remote_storage_plugin.<plugin>.codec_options`` are codec settings too) over the store
    :func:`open_lmcache_store` opens for LMCache's ``metadata``: its ``model_name`` (its identity keys the chunks
    and names a kvtc calibration), ``kv_shape`` ``(L, 2, chunk_size, H, D)`` and ``kv_dtype`` (what the engine
    holds: every chunk is checked against it; ``num_heads`` defaults to its H), ``worker_id`` and
    ``world_size``.  ``workers`` (default 2) threads do the storage and codec work off LMCache's event loop."""
    options = (extra or {}).get(f"remote_storage_plugin.{plugin}.codec_options") or {}
    store_config, own = url_config(url, options)
    kv_shape = getattr(metadata, "kv_shape", None)
    num_heads = own.get("num_heads") or (kv_shape[3] if kv_shape else None)
    dtype = getattr(metadata, "kv_dtype", None)
    store = open_lmcache_store(store_config, model_name=getattr(metadata, "model_name", None),
                               shape=_engine_shape(metadata), chunk_tokens=int(kv_shape[2]) if kv_shape else None,
                               kv_dtype=str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else "",
                               tp_rank=int(getattr(metadata, "worker_id", 0) or 0),
                               tp_size=int(getattr(metadata, "world_size", 1) or 1))
    return KVCodecRemoteConnector(store, int(num_heads) if num_heads else None, local_cpu_backend=local_cpu_backend,
                                  loop=loop, metadata=metadata, config=config,
                                  max_workers=int(own.get("workers", 2)))


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
