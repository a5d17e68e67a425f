"""kvcodec's serializer for the L2 adapters of LMCache's multiprocess server (``register_serde_factory``, type
``"kvcodec"``).

Each object is written as the store writes a chunk, bound to LMCache's object key: a single-chunk container naming
the key (``meta.store_key``: :meth:`KVStore.engine_key` of every field of the key), sealed with the deployment's
secret when there is one.  It is read back only through the store's one check (:meth:`ChunkSource.check`:
authentication, the key it was written for, the model, the shape of the destination buffer, a size bound taken from
that shape before anything is decoded), so an object copied under another key, or written without the secret, is
refused (the load is a miss and LMCache recomputes).  In the byte buffer, the value follows its length (8 bytes,
little-endian): LMCache loads an object into a buffer sized by ``estimate_serialized_size``, so bytes of no meaning
follow it there.
"""

from __future__ import annotations

import abc
import logging
import struct
import threading
from typing import Any

import torch

from kvcodec.cache import KVCache
from kvcodec.engines.lmcache.settings import open_lmcache_store, serde_config
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.store import ChunkShape, KVStore
from kvcodec.store.config import StoreConfig

log = logging.getLogger(__name__)

try:  # pragma: no cover - LMCache is not installed in the CPU test environment
    from lmcache.v1.distributed.serde import AsyncSerdeProcessor, Deserializer, Serializer, register_serde_factory
    HAVE_LMCACHE_SERDE = True
except Exception:
    HAVE_LMCACHE_SERDE = False
    AsyncSerdeProcessor = None  # type: ignore[assignment,misc]
    register_serde_factory = None  # type: ignore[assignment]

    class Serializer(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for LMCache's serde ``Serializer``."""

    class Deserializer(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for LMCache's serde ``Deserializer``."""


SERIALIZED_LENGTH = struct.Struct("<Q")
VALUE_OVERHEAD = 1 << 16  # header, index, tables and tag beyond the element bytes (an upper bound for the estimate)
KEY_CONTEXT = b"lmcache-object/1\0"  # keeps the server's object keys apart from other engines' names


def object_key_name(key: Any) -> str:
    """An LMCache ``ObjectKey`` as text: every field that tells two objects apart."""
    salt = f"@{key.cache_salt}" if key.cache_salt else ""
    return f"lmcache@{key.model_name}@{key.kv_rank:x}@{key.object_group_id:x}@{key.chunk_hash.hex()}{salt}"


def _tensor(obj: Any) -> torch.Tensor:
    return obj.tensor if hasattr(obj, "tensor") else obj


class ServerStores:
    """The stores of one serde configuration, one per model (an object key's ``model_name``) and chunk shape,
    opened on first use (:func:`open_lmcache_store`: the model's identity, the calibration policy)."""

    def __init__(self, config: StoreConfig, num_heads: int) -> None:
        self.config, self.num_heads = config, num_heads
        self._stores: dict[tuple[str, ChunkShape], KVStore] = {}
        self._lock = threading.Lock()

    def shape(self, chunk: torch.Tensor) -> ChunkShape:
        """What a ``[2, L, T, H*D]`` buffer holds per token."""
        if chunk.dim() != 4 or chunk.shape[0] != 2 or chunk.shape[3] % self.num_heads:
            raise InvalidInputError(f"a [2, L, T, H*D] buffer with H={self.num_heads} is needed, "
                                    f"not {tuple(chunk.shape)}")
        dim = chunk.shape[3] // self.num_heads
        return ChunkShape(int(chunk.shape[1]), self.num_heads, dim, dim, str(chunk.dtype).removeprefix("torch."))

    def for_object(self, key: Any, shape: ChunkShape) -> tuple[KVStore, str]:
        """The store of ``key``'s model and ``shape``, and the store key ``key``'s value is bound to."""
        with self._lock:  # opening may calibrate (calibrate="now"): the other workers wait for the same store
            store = self._stores.get((key.model_name, shape))
            if store is None:
                store = open_lmcache_store(self.config, model_name=key.model_name, shape=shape, kv_dtype=shape.dtype)
                self._stores[(key.model_name, shape)] = store
        return store, store.engine_key(object_key_name(key), KEY_CONTEXT)


class KVCodecSerializer(Serializer):
    """LMCache serde ``Serializer``: ``[2, L, T, H*D]`` in ``src``, written into ``dst`` as the store's value for
    ``key`` after its length."""

    def __init__(self, stores: ServerStores) -> None:
        self.stores = stores

    def serialize(self, src: Any, dst: Any, key: Any) -> int:
        chunk = _tensor(src).detach().cpu()
        store, store_key = self.stores.for_object(key, self.stores.shape(chunk))
        kv = KVCache.from_lmcache(chunk, self.stores.num_heads, model=store.model)
        value = store.encode_chunk(store_key, kv)
        data = SERIALIZED_LENGTH.pack(len(value)) + value
        out = _tensor(dst).view(torch.uint8).reshape(-1)
        if len(data) > out.numel():
            raise InvalidInputError(f"the encoded chunk ({len(data)} bytes) does not fit the {out.numel()}-byte buffer")
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        """An upper bound of the serialized size: the raw bytes (no codec expands beyond them much) and room for
        the container around them."""
        shapes = getattr(layout_desc, "shapes", None) or [layout_desc]
        dtypes = getattr(layout_desc, "dtypes", None) or [torch.float16]
        raw = sum(torch.Size(s).numel() * d.itemsize + 16 * (int(s[2]) if len(s) > 2 else 0)
                  for s, d in zip(shapes, dtypes))
        return SERIALIZED_LENGTH.size + raw + VALUE_OVERHEAD


class KVCodecDeserializer(Deserializer):
    """LMCache serde ``Deserializer``: the value at the start of ``src`` (whatever follows it), checked by the
    store as ``key``'s chunk of ``dst``'s shape, decoded into ``dst``; raises :class:`CorruptDataError` (LMCache's
    load fails: a miss) for a value that is not."""

    def __init__(self, stores: ServerStores) -> None:
        self.stores = stores

    def deserialize(self, src: Any, dst: Any, key: Any) -> None:
        raw = _tensor(src).reshape(-1).view(torch.uint8).cpu().numpy()
        if raw.size < SERIALIZED_LENGTH.size:
            raise CorruptDataError(f"a {raw.size}-byte buffer is too short for a serialized kvcodec chunk")
        (n,) = SERIALIZED_LENGTH.unpack(raw[: SERIALIZED_LENGTH.size].tobytes())
        if n > raw.size - SERIALIZED_LENGTH.size:
            raise CorruptDataError(f"the serialized chunk claims {n} bytes; its {raw.size}-byte buffer holds fewer")
        out = _tensor(dst)
        store, store_key = self.stores.for_object(key, self.stores.shape(out))
        value = raw[SERIALIZED_LENGTH.size: SERIALIZED_LENGTH.size + n].tobytes()
        out.copy_(store.decode_value(store_key, value, int(out.shape[2])).to_lmcache().to(out.dtype))


def make_serde(settings: dict[str, Any] | None = None) -> Any:
    """The serde factory: ``{"codec": ..., "num_heads": H, "max_workers": ...}`` and the store's other settings
    (:class:`StoreConfig`: ``codec_options`` or codec settings beside ``codec``, ``model``, ``namespace``,
    ``secret_file``, ``calibrate``, ``calibration_options``, ...).  ``num_heads``: the KV heads of LMCache's
    ``[2, L, T, H*D]`` objects; ``max_workers``: threads of LMCache's ``AsyncSerdeProcessor`` (default 1)."""
    config, own = serde_config(settings)
    num_heads = own.get("num_heads")
    if not (isinstance(num_heads, int) and num_heads > 0):
        raise InvalidInputError(f"the kvcodec serde needs num_heads, the KV heads of LMCache's [2, L, T, H*D] "
                                f"objects, not {num_heads!r}")
    stores = ServerStores(config, num_heads)
    ser, de = KVCodecSerializer(stores), KVCodecDeserializer(stores)
    if AsyncSerdeProcessor is not None:  # pragma: no cover - needs LMCache
        return AsyncSerdeProcessor(ser, de, max_workers=int(own.get("max_workers", 1)))
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
