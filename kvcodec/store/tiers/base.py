"""The interface every storage tier implements: a byte store with put/get/contains/delete/keys/size.

Values are opaque bytes (single-chunk kvcodec containers); the containers carry their own checksums, so a tier
never has to vouch for its bytes.  Every tier is thread safe.  Tiers with a byte budget evict least-recently-used
values and hand them to ``on_evict`` (the store uses it to demote them to the next tier down).
"""

from __future__ import annotations

from typing import Callable

EvictFn = Callable[[str, bytes], None]

# A stored value is one chunk's container, a few MB; a value past this is not one of ours, and reading it whole would
# be an allocation chosen by whoever wrote it.
DEFAULT_MAX_VALUE_BYTES = 1 << 30


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

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether each of ``keys`` is held; remote tiers answer in one round trip (a prefix lookup asks for
        every chunk of a prompt at once)."""
        return [self.contains(k) for k in keys]

    def value_sizes(self, keys: list[str]) -> list[int | None]:
        """The size in bytes of each of ``keys``' values, None where not held, in one round trip where the tier
        can: a load plans which variant of each chunk to fetch from them.  (This default reads the values.)"""
        return [None if (v := self.get(k)) is None else len(v) for k in keys]

    # Tiers that can read part of a value say so: a load then reads a large value in pieces and can give it up
    # for a smaller variant of its chunk between two pieces.
    ranged_reads = False

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        """Bytes ``offset .. offset+length-1`` of ``key``'s value (fewer at its end), None when not held.  Nothing
        checks them: the caller checks the whole value it assembles."""
        value = self.get(key)
        return None if value is None else value[offset:offset + length]

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
