"""The interface every storage tier implements: a byte store with put/get/contains/delete/keys/size.

Values are opaque bytes (single-chunk kvcodec containers); the containers carry their own checksums, so a tier
never has to vouch for its bytes.  Every tier is thread safe.  Tiers with a byte budget evict least-recently-used
values and hand them to ``on_evict`` (the store uses it to demote them to the next tier down).
"""

from __future__ import annotations

from typing import Callable

from kvcodec.errors import LimitExceededError

EvictFn = Callable[[str, bytes], None]

# A stored value is one chunk's container, a few MB; a value past this is not one of ours, and reading it whole would
# be an allocation chosen by whoever wrote it.
DEFAULT_MAX_VALUE_BYTES = 1 << 30


class StorageTier:
    """Base class.  Subclasses implement the six operations; none of them raises on a backend fault (a tier that
    cannot answer reports a miss, ``False`` or an empty list instead).  A read raises only for a value that is
    itself bad: :class:`~kvcodec.errors.LimitExceededError` for one larger than the bound the reader asked for (or
    the tier's own), having read no more than that bound, and :class:`~kvcodec.errors.CorruptDataError` for one
    the tier's own bookkeeping shows damaged; the reader decides whether to evict it."""

    name = "tier"
    capacity_bytes: int | None = None

    def __init__(self) -> None:
        self.on_evict: EvictFn | None = None

    def put(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` (replacing any old value); True when it was stored."""
        raise NotImplementedError

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """``key``'s value, None when not held; a value over ``max_bytes`` raises (see the class)."""
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

    def get_range(self, key: str, offset: int, length: int, max_bytes: int | None = None) -> bytes | None:
        """Bytes ``offset .. offset+length-1`` of ``key``'s value (fewer at its end, none past ``max_bytes``), None
        when not held.  Nothing checks them: the caller checks the whole value it assembles."""
        value = self.get(key, max_bytes)
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


def check_size(tier: StorageTier, key: str, size: int, *bounds: int | None) -> None:
    """Raise :class:`LimitExceededError` when ``key``'s ``size`` bytes exceed the least of ``bounds`` (None: no
    bound)."""
    limit = min((b for b in bounds if b is not None), default=None)
    if limit is not None and size > limit:
        raise LimitExceededError(f"tier {tier.name}: {key} holds {size} bytes, more than the {limit} a read may take")
