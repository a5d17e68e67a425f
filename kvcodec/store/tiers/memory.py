"""Tiers in memory: process memory (:class:`MemoryTier`) and device memory (:class:`GPUTier`), each LRU within a
byte budget."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from kvcodec.errors import InvalidInputError
from kvcodec.store.tiers.base import StorageTier, check_size

log = logging.getLogger(__name__)


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

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        with self._lock:
            stored = self._items.get(key)
            if stored is None:
                return None
            check_size(self, key, self._nbytes(stored), max_bytes)
            self._items.move_to_end(key)
        return self._load(stored)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def value_sizes(self, keys: list[str]) -> list[int | None]:
        with self._lock:
            return [None if (v := self._items.get(k)) is None else self._nbytes(v) for k in keys]

    ranged_reads = True

    def get_range(self, key: str, offset: int, length: int, max_bytes: int | None = None) -> bytes | None:
        value = self.get(key, max_bytes)  # a memory tier's get is a reference (or one device copy), not a transfer
        return None if value is None else value[offset:offset + length]

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
