"""An SGLang HiCache storage backend: SGLang's KV pages, each compressed by a kvcodec codec, kept in kvcodec tiers.

SGLang's hierarchical cache keeps KV in GPU memory, then host memory (its host pool, "L2"), then a storage backend
("L3") that it reads and writes a page at a time under its own page hashes (chained over the tokens).  This backend
is loaded through SGLang's ``StorageBackendFactory`` with its ``dynamic`` backend config::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name":"kvcodec","module_path":"kvcodec.engines.sglang_hicache","class_name":"KVCodecHiCacheStorage",
          "interface_v1":1,"tiers":["disk:/var/cache/kvcodec","redis://127.0.0.1:6379/0"],"codec":"cachegen"}'

The JSON holds SGLang's own keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``), this
backend's ``model_path`` (the folder or weight file whose bytes identify the model; default SGLang's model name,
which is its ``--model-path`` unless ``--served-model-name`` is set) and the store's settings, parsed as every
hook's are (:class:`~kvcodec.store.config.StoreConfig`: ``tiers``, ``codec``, ``codec_options``, ``namespace``,
``model``, ``secret_file``, ...; an unknown key stops start-up).  ``model`` is the name kvcodec knows the model by
(default SGLang's model name with ``/`` as ``-``); cachegen's and kvfetcher's channel profile is the one of that
name, else the one measured on a model of the served folder's configuration (as every hook finds it), and the log
says which or that there is none.  ``"interface_v1": 1`` makes SGLang call the page methods (``batch_get_v1``/``batch_set_v1``), which read
and write its host pool in place; without it SGLang copies each page through a flat buffer
(``batch_get``/``batch_set``).

Every page is stored as a single-chunk container of ``page_size`` tokens, of all the pool's layers and this rank's
heads, whatever the host pool's layout (a page written from a ``layer_first`` pool loads into a ``page_first``
one).  It is kept by a :class:`~kvcodec.store.KVStore` (made by :func:`~kvcodec.engines.store_setup.open_store`
with the pool's shape and page size) under :meth:`KVStore.engine_key` of SGLang's page hash, seeded by the model
identity (its configuration and weights: two checkpoints served under one name never share pages), the codec and
its settings, the page size, KV dtype, TP and PP rank and namespace.  A value is only served once the store's one
check accepts it for that key and the pool's shape (authentication, checksums, the key it names, token count,
layers, heads, dtype; bounded before anything is decoded): anything else is a miss, evicted when the value itself
is bad, and no exception reaches SGLang.  A page is written to the fastest tier and every tier that is not process
memory; a hit in a slower tier is copied to the fastest.  With a list of codecs (variants, smallest first) every page
is stored in each, and each page is loaded in the one that restores soonest by the store's estimates of its links and
decode rates (:meth:`KVStore.load_chunk`), the other when that one is missing or bad.

Not handled, refused at start-up with an error that says so: MLA and other rank-replicated pools, context
parallelism, FP8 KV, keys and values of different head sizes, a ``chunk_tokens`` other than SGLang's page size,
and codecs that need each token's position (``kvtc``: SGLang does not pass positions to the page calls).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.codecs import Codec, get_codec
from kvcodec.codecs.registry import codec_from_spec
from kvcodec.engines.store_setup import open_store
from kvcodec.errors import InvalidInputError
from kvcodec.store import CacheIdentity, ChunkShape, KVStore, StorageTier
from kvcodec.store.config import StoreConfig
from kvcodec.store.identity import model_identity

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
except ImportError as err:  # pragma: no cover - the backend only exists inside SGLang
    raise ImportError("kvcodec.engines.sglang_hicache runs inside SGLang: install sglang (scripts/setup_sglang.sh "
                      f"makes a virtual environment with it): {err}") from err

log = logging.getLogger(__name__)

KEY_CONTEXT = b"sglang-hicache/1\0"
# The extra config's keys that are not the store's: SGLang's own (the dynamic backend's loader, the page interface)
# and the folder or file that identifies the model.
HOOK_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "model_path")
WHERE = "--hicache-storage-backend-extra-config"
# How each host pool layout's page (``get_data_page(i, flat=False)``) becomes ``(2, layers, heads, tokens, dim)``:
# keys then values, each layer's ``[heads, tokens, dim]`` as a KVCache holds it.  All are views of the page.
CANONICAL: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "layer_first": lambda p: p.permute(0, 1, 3, 2, 4),              # (2, L, T, H, D)
    "page_first": lambda p: p.permute(0, 2, 3, 1, 4),               # (2, T, L, H, D)
    "page_first_direct": lambda p: p[:, 0].permute(0, 1, 3, 2, 4),  # (2, 1, L, T, H, D)
    "page_head": lambda p: p[:, 0].permute(0, 3, 1, 2, 4),          # (2, 1, H, T, L, D)
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _never_raises(default: Any) -> Callable:
    """SGLang's storage threads must not die on a storage fault: log it, answer ``default`` (a miss)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(self: KVCodecHiCacheStorage, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                log.warning("kvcodec HiCache backend: %s failed; answered as a miss", fn.__name__, exc_info=True)
                return default([] if not args else args[0]) if callable(default) else default
        return call
    return wrap


class PoolPages:
    """SGLang's MHA host pool, page by page, as KVCaches: reads and writes go through views of the pool's memory."""

    def __init__(self, pool: Any) -> None:
        layout = getattr(pool, "layout", None)
        if not hasattr(pool, "kv_buffer") or getattr(pool, "head_dim", None) != getattr(pool, "v_head_dim", None):
            raise InvalidInputError(f"kvcodec's HiCache backend takes MHA host pools whose keys and values have one "
                                    f"head size (MHATokenToKVPoolHost), not {type(pool).__name__}")
        if layout not in CANONICAL:
            raise InvalidInputError(f"host pool layout {layout!r} is not supported; use one of {sorted(CANONICAL)}")
        if pool.dtype not in DTYPES:
            raise InvalidInputError(f"KV in {pool.dtype} is not supported (float16, bfloat16 or float32)")
        self.pool, self.to_canonical = pool, CANONICAL[layout]
        self.page_size, self.layers, self.heads, self.dim = pool.page_size, pool.layer_num, pool.head_num, pool.head_dim
        self.page_shape = tuple(pool.get_data_page(0, flat=False).shape)
        self.page_numel = 2 * self.layers * self.heads * self.page_size * self.dim

    def shape(self) -> ChunkShape:
        return ChunkShape(self.layers, self.heads, self.dim, self.dim, str(self.pool.dtype).removeprefix("torch."))

    def at(self, index: int) -> torch.Tensor:
        """The canonical view of the page that starts at token slot ``index`` of the pool."""
        return self.to_canonical(self.pool.get_data_page(int(index), flat=False))

    def of_flat(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The canonical view of a flat page (laid out as the pool's ``get_data_page(i)``), None if it is not one."""
        if not isinstance(flat, torch.Tensor) or flat.numel() != self.page_numel or flat.dtype != self.pool.dtype:
            return None
        return self.to_canonical(flat.view(self.page_shape))

    def to_kv(self, page: torch.Tensor, model: str) -> KVCache:
        return KVCache([(page[0, l], page[1, l]) for l in range(self.layers)], model=model)

    @staticmethod
    def fill(page: torch.Tensor, kv: KVCache) -> None:
        for l, layer in enumerate(kv.layers):
            page[0, l].copy_(layer.keys)
            page[1, l].copy_(layer.values)


class KVCodecHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a kvcodec :class:`KVStore` (see the module docstring).  SGLang makes it with
    ``(storage_config, kwargs)`` and then hands it its host pool (:meth:`register_mem_pool_host`), which fixes the
    page shape: until then every read misses and every write fails."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        if storage_config.is_mla_model:
            raise InvalidInputError("kvcodec's HiCache backend does not handle MLA (rank-replicated) KV pools")
        if storage_config.attn_cp_size > 1 or storage_config.dcp_size > 1:
            raise InvalidInputError("kvcodec's HiCache backend does not handle context-parallel KV (each rank holds "
                                    "part of every page)")
        self.settings, own = StoreConfig.parse(storage_config.extra_config, hook_keys=HOOK_KEYS, where=WHERE)
        for codec in _codecs(self.settings):
            if codec.uses_positions:
                raise InvalidInputError(f"codec {codec.codec_id} needs each token's position, which SGLang's page "
                                        "calls do not give; use raw, cachegen, kivi or kvfetcher")
        served = storage_config.model_name or ""
        self.model = self.settings.model or served.replace("/", "-") or "unnamed"
        path = own.get("model_path") or served
        if not isinstance(path, str) or not path:
            raise InvalidInputError(f"{WHERE}: SGLang names no model, so give \"model_path\" (the model's folder or "
                                    "weight file), whose identity keys its pages")
        self.model_path, self.model_digest = path, model_identity(path)
        # made now, so that a bad tier URL stops start-up before the host pool exists
        self.tiers: list[StorageTier] = self.settings.make_tiers()
        self.config = storage_config
        self.pages: PoolPages | None = None
        self.store: KVStore | None = None
        self.stats = {"hits": 0, "misses": 0, "puts": 0}
        self._lock = threading.Lock()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: its layout, page size and shape make the store (an unsupported pool stops SGLang's
        start-up with an error naming it)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = PoolPages(mem_pool_host)
        if self.settings.chunk_tokens not in (None, pages.page_size):
            raise InvalidInputError(f"{WHERE}: 'chunk_tokens' is SGLang's page size ({pages.page_size}) here, not "
                                    f"{self.settings.chunk_tokens}: the backend stores whole pages")
        c = self.config
        identity = CacheIdentity(model_digest=self.model_digest, kv_dtype=pages.shape().dtype, tp_rank=c.tp_rank,
                                 tp_size=c.tp_size, pp_rank=c.pp_rank, pp_size=c.pp_size)
        self.store = open_store(self.settings, model=self.model, identity=identity, log=log.info,
                                shape=pages.shape(), engine_chunk_tokens=pages.page_size, tiers=self.tiers,
                                model_path=self.model_path)
        self.pages = pages
        log.info("kvcodec HiCache backend: codec %s, tiers %s, pages of %d tokens x %d layers x %d heads x %d (%s, "
                 "layout %s)", "/".join(c.codec_id for c in self.store.variants), [t.name for t in self.tiers],
                 pages.page_size, pages.layers, pages.heads, pages.dim, pages.shape().dtype, mem_pool_host.layout)

    # keys and the store -------------------------------------------------------------------------
    def key(self, page_hash: str) -> str:
        """The tier key of SGLang's page ``page_hash`` (:meth:`KVStore.engine_key`: it names the model, codec, page
        size, dtype and rank too)."""
        return self._store().engine_key(page_hash, KEY_CONTEXT)

    def _store(self) -> KVStore:
        if self.store is None:
            raise InvalidInputError("SGLang has not registered its host pool with the backend yet")
        return self.store

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    def _load(self, page_hash: str, dest: torch.Tensor) -> bool:
        """Fill ``dest`` (a canonical page view) from the fastest tier holding the page intact; False: a miss."""
        kv = self._store().load_chunk(self.key(page_hash), self.pages.page_size)
        if kv is None:
            self._count("misses")
            return False
        PoolPages.fill(dest, kv)
        self._count("hits")
        return True

    def _save(self, page_hash: str, page: torch.Tensor) -> bool:
        """Encode the page (a canonical view) once and write it to every tier that lacks it."""
        store, key = self._store(), self.key(page_hash)
        if store.put_chunk(key, self.pages.to_kv(page, store.model)):
            self._count("puts")
            return True
        # nothing written: the put tiers hold it already, or none that lacks it took it
        return store.holds_chunk(key)

    # SGLang's interface ----------------------------------------------------------------------------
    @_never_raises(None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page ``key`` in ``target_location`` (a flat page as the host pool lays it out; a new one if None)."""
        pages = self.pages
        if pages is None:
            return None
        target = pages.pool.get_dummy_flat_data_page() if target_location is None else target_location
        dest = pages.of_flat(target)
        if dest is None:
            log.warning("kvcodec HiCache backend: a target of %s elements for a page of %d; a miss",
                        getattr(target, "numel", lambda: "?")(), pages.page_numel)
            return None
        return target if self._load(key, dest) else None

    @_never_raises(lambda keys: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        """The pages of ``keys``; SGLang uses the leading hits only, so after the first miss nothing is read."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        targets = target_locations if target_locations is not None else [None] * len(keys)
        for i, (key, target) in enumerate(zip(keys, targets)):
            out[i] = self.get(key, target)
            if out[i] is None:
                break
        return out

    @_never_raises(False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store the flat page ``value`` (as the host pool's ``get_data_page(i)`` gives it) under ``key``."""
        if self.pages is None:
            return False
        page = self.pages.of_flat(value.contiguous() if isinstance(value, torch.Tensor) else value)
        if page is None:
            log.warning("kvcodec HiCache backend: %s is not a page of this pool; not stored", key)
            return False
        return self._save(key, page)

    @_never_raises(False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        return all([self.set(k, v) for k, v in zip(keys, values)])

    @_never_raises(False)
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @_never_raises(0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored whole (:meth:`KVStore.held_prefix`: a torn page is
        evicted here and answers absent, so SGLang never reserves host memory for a page whose read would fail)."""
        if self.store is None or not keys:
            return 0
        return self.store.held_prefix([self.key(k) for k in keys])

    def _page_starts(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int] | None:
        ps = self.pages.page_size if self.pages is not None else 0
        if not ps or host_indices is None or host_indices.numel() != len(keys) * ps:
            log.warning("kvcodec HiCache backend: %s host slots for %d pages of %d tokens",
                        None if host_indices is None else host_indices.numel(), len(keys), ps)
            return None
        return [int(x) for x in host_indices.reshape(-1)[::ps].tolist()]

    @_never_raises(lambda keys: [False] * len(keys))
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load the pages of ``keys`` straight into the host pool at ``host_indices`` (``page_size`` slots per
        key); after the first miss nothing is read (SGLang keeps the leading hits only)."""
        starts = self._page_starts(keys, host_indices)
        out = [False] * len(keys)
        for i, (key, start) in enumerate(zip(keys, starts or [])):
            out[i] = self._load(key, self.pages.at(start))
            if not out[i]:
                break
        return out

    @_never_raises(lambda keys: [False] * len(keys))
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``."""
        starts = self._page_starts(keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        return [self._save(key, self.pages.at(start)) for key, start in zip(keys, starts)]

    @_never_raises(False)
    def clear(self) -> bool:
        """Delete every page of this model and namespace from every tier."""
        store = self._store()
        for key in store.keys():
            store.delete(key)
        return True

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        else:
            for tier in self.tiers:
                tier.close()


def _codecs(settings: StoreConfig) -> list[Codec]:
    """The codecs ``settings`` name (each variant of a list), made to be checked before the host pool exists."""
    if isinstance(settings.codec, str):
        return [get_codec(settings.codec, **settings.codec_options)]
    return [codec_from_spec(spec) for spec in settings.codec]
