"""Where a store's chunks come from: its tiers, read fastest first and checked (:class:`ChunkSource`).

A source reads, checks and discards values; it decodes nothing and keeps no statistics of time: every read
reports its bytes and seconds to an ``observe(tier, nbytes, seconds)`` callback, which a store points at its
telemetry (:mod:`kvcodec.store.telemetry`).

A stored value is a single-chunk container whose header names the key it was written for (``meta.store_key``),
followed, when the store has a secret, by an authentication tag (:mod:`kvcodec.store.auth`).  Before a chunk is
served it must be intact (every checksum), authentic (with a secret), the chunk asked for (its key, model and
token count) and, when the store knows what its engine holds (``shape``), of exactly that shape and dtype; no
read takes more bytes than such a chunk can hold, and no decode more than its size.  A value failing any of these
is *bad*: it is evicted from the tier it came from when it is under one of this store's own keys.  Anything else
that stops a load on this machine (a missing kvtc calibration, memory, a newer format) is a miss that leaves the
shared entry alone.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvcodec.codecs import Codec
from kvcodec.container import ContainerFile
from kvcodec.errors import CorruptDataError, InvalidInputError, KVCodecError, LimitExceededError
from kvcodec.formats.v1 import FOOTER, FOOTER_MAGIC
from kvcodec.reader import build_codecs
from kvcodec.store.auth import TAG_BYTES, unseal
from kvcodec.store.chunks import ChunkShape, FetchedChunk
from kvcodec.store.keys import format_key
from kvcodec.store.tiers import StorageTier

log = logging.getLogger(__name__)

# Without a known shape a chunk's decode may still not take more than this (the header limits alone allow one
# layer tens of gigabytes); a 256-token chunk of a 70B-class model in float16 is 80 MiB.
DEFAULT_MAX_CHUNK_BYTES = 256 << 20
STORE_KEY_META = "store_key"
# A stored value is its decoded size or less (every codec here compresses, raw is the rows themselves) plus the
# container's header, index and checksums and the authentication tag: a few KB.  The slack leaves room for a codec
# that expands incompressible rows a little, and bounds what a read of an oversized value can cost.
VALUE_SLACK_BYTES = 64 << 10

Observer = Callable[[str, int, float], None]
BAD_VALUE = (CorruptDataError, LimitExceededError)


@dataclass
class PlacementPolicy:
    """Where chunks go.

    ``put_tiers``: the tier names a ``put`` writes to (None: the fastest tier and every
    tier from ``shared`` on, so that other machines can find the chunk).
    ``promote_on_hit``: a chunk read from a slower tier is copied to tier ``promote_to``.
    ``demote_on_evict``: a chunk that a tier evicts (LRU over its byte budget) moves to the
    next tier down unless that tier already holds it.
    """

    put_tiers: Sequence[str] | None = None
    shared: Sequence[str] = field(default_factory=lambda: ("redis",))
    promote_on_hit: bool = True
    promote_to: int = 0
    demote_on_evict: bool = True


def call_tier(tier: StorageTier, op: str, *args: Any, default: Any = None) -> Any:
    """Call a tier operation; a tier that raises anything but a bad value's error (built-in tiers raise nothing
    else) counts as a miss, with a warning."""
    try:
        return getattr(tier, op)(*args)
    except BAD_VALUE:
        raise
    except Exception:
        log.warning("tier %s: %s failed", tier.name, op, exc_info=True)
        return default


class ChunkSource:
    """The chunks of one store (``model``, ``namespace``) in ``tiers`` (fastest first) under ``policy``, checked
    against ``secret``, ``shape`` (:class:`ChunkShape` or None) and ``chunk_tokens``; ``max_chunk_bytes`` bounds a
    decode where there is no shape.  ``observe`` gets every read's tier, bytes and seconds.  ``stats`` counts
    hits, misses, bad values, promotions, demotions, puts and the bytes of the values put."""

    def __init__(self, tiers: Sequence[StorageTier], *, model: str, namespace: str = "", secret: bytes | None = None,
                 shape: ChunkShape | None = None, chunk_tokens: int, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 policy: PlacementPolicy | None = None, observe: Observer | None = None) -> None:
        if not tiers:
            raise InvalidInputError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"tier names must be unique, got {names}")
        if not (isinstance(max_chunk_bytes, int) and max_chunk_bytes > 0):
            raise InvalidInputError(f"max_chunk_bytes must be a positive integer, not {max_chunk_bytes!r}")
        self.tiers = list(tiers)
        self.model, self.secret, self.shape = model, secret, shape
        self.chunk_tokens, self.max_chunk_bytes = chunk_tokens, max_chunk_bytes
        self.policy = policy or PlacementPolicy()
        self.observe: Observer = observe or (lambda tier, nbytes, seconds: None)
        self.key_prefix = format_key(model, b"", namespace)  # every key of this store starts so
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "promoted": 0, "demoted": 0, "puts": 0, "put_bytes": 0}
        self._lock = threading.Lock()
        self._side_checked: set[tuple[str, str]] = set()  # (tier, name): side data found intact there
        for i, tier in enumerate(self.tiers):
            tier.on_evict = self._demoter(i)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    def tier(self, name: str) -> StorageTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise InvalidInputError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")

    def own(self, key: str) -> bool:
        """Whether ``key`` is one of this store's chunk keys (its model and namespace)."""
        return key.startswith(self.key_prefix)

    # bounds ------------------------------------------------------------------------------------
    def max_bytes(self, tokens: int | None = None) -> int:
        """The most a decode of a ``tokens``-token chunk (default ``chunk_tokens``) may produce: the engine's shape,
        or ``max_chunk_bytes``."""
        tokens = tokens or self.chunk_tokens
        return self.shape.output_bytes(tokens) if self.shape is not None else self.max_chunk_bytes

    def max_value_bytes(self, tokens: int | None = None) -> int:
        """The most a stored value of a ``tokens``-token chunk may hold (what a read asks a tier for at most)."""
        limit = self.max_bytes(tokens)
        return limit + limit // 16 + VALUE_SLACK_BYTES

    # writing -----------------------------------------------------------------------------------
    def put_tiers(self) -> list[StorageTier]:
        """The tiers a put writes to (see :class:`PlacementPolicy`)."""
        if self.policy.put_tiers is not None:
            return [self.tier(n) for n in self.policy.put_tiers]
        out = [self.tiers[0]]
        shared = [i for i, t in enumerate(self.tiers) if t.name in self.policy.shared]
        if shared:
            out += [t for t in self.tiers[min(shared):] if t is not self.tiers[0]]
        return out

    def missing_from(self, key: str, tiers: Sequence[StorageTier]) -> list[StorageTier]:
        return [t for t in tiers if not call_tier(t, "contains", key, default=False)]

    def write(self, key: str, value: bytes, tiers: Sequence[StorageTier]) -> bool:
        """Put ``value`` under ``key`` in each of ``tiers``; True when any took it."""
        return any([call_tier(t, "put", key, value, default=False) for t in tiers])

    def _demoter(self, index: int) -> Callable[[str, bytes], None]:
        def demote(key: str, value: bytes) -> None:
            if not self.policy.demote_on_evict:
                return
            for lower in self.tiers[index + 1:]:
                if call_tier(lower, "contains", key, default=False):
                    return
                if call_tier(lower, "put", key, value, default=False):
                    self.count("demoted")
                    return
        return demote

    # side data ---------------------------------------------------------------------------------
    # A codec that decodes with side data (kvtc's calibration) gets it stored once, by name, beside the chunks, so a
    # store on another machine that shares the tiers can decode them.
    def hold_side_data(self, codecs: Sequence[Codec], tiers: Sequence[StorageTier]) -> None:
        """Make each tier of ``tiers`` hold an intact copy of the side data of ``codecs`` this machine has: a copy
        not yet seen intact here is read and compared, and a missing or damaged one (re)written."""
        for codec in codecs:
            name = codec.side_data_name()
            if name is None or not codec.has_side_data():
                continue
            data = codec.side_data()
            for t in tiers:
                if (t.name, name) in self._side_checked:
                    continue
                try:
                    stored = call_tier(t, "get", name)
                except BAD_VALUE:
                    stored = None
                if stored != data:
                    if stored is not None:
                        log.warning("tier %s holds damaged side data %s; rewritten", t.name, name)
                    if not call_tier(t, "put", name, data, default=False):
                        continue
                self._side_checked.add((t.name, name))

    def fetch_side_data(self, codecs: Sequence[Codec]) -> None:
        """Install what ``codecs`` need beyond their bytes (kvtc's calibration) from the tiers where this machine
        lacks it; a damaged copy is evicted (a machine that has it writes it back on its next put)."""
        for codec in codecs:
            name = codec.side_data_name()
            if name is None or codec.has_side_data():
                continue
            for t in self.tiers:
                try:
                    data = call_tier(t, "get", name)
                    if data is None:
                        continue
                    codec.install_side_data(data)
                    break
                except KVCodecError as err:
                    log.warning("tier %s holds damaged side data %s (%s); evicted", t.name, name, err)
                    self._side_checked.discard((t.name, name))
                    call_tier(t, "delete", name, default=False)

    # reading -----------------------------------------------------------------------------------
    def read(self, key: str, start: int = 0, end: int | None = None, *,
             observe: Observer | None = None) -> FetchedChunk | None:
        """The chunk of tokens ``start .. end-1`` stored under ``key`` (``end`` None: as many as were written for it),
        from the fastest tier that holds it intact (:meth:`check`); a bad value is discarded (:meth:`discard`) and
        the next tier tried.  A hit in a slower tier is promoted as the policy says.  None when no tier holds it
        intact.  ``observe``, beside the source's own observer, gets every value read (the chunk's is the last)."""
        bound = self.max_value_bytes(None if end is None else end - start)
        for tier in self.tiers:
            t0 = time.perf_counter()
            try:
                value = call_tier(tier, "get", key, bound)
            except BAD_VALUE as err:
                self.discard(FetchedChunk(key, tier.name, start, start if end is None else end, b""), err)
                continue
            if value is None:
                continue
            seconds = time.perf_counter() - t0
            self.observe(tier.name, len(value), seconds)
            if observe is not None:
                observe(tier.name, len(value), seconds)
            chunk = self.accept(key, tier.name, value, start, end)
            if chunk is not None:
                return chunk
        self.count("misses")
        return None

    def read_range(self, tier: str, key: str, offset: int, length: int, tokens: int, *,
                   observe: bool = True) -> bytes | None:
        """Bytes ``offset .. offset+length-1`` of the value of a ``tokens``-token chunk under ``key`` in ``tier``
        (never past such a chunk's bound), unchecked: the caller checks the whole value with :meth:`accept`.  With
        ``observe`` False the read does not feed the link's estimate (the caller judges it first)."""
        t0 = time.perf_counter()
        try:
            piece = call_tier(self.tier(tier), "get_range", key, offset, length, self.max_value_bytes(tokens))
        except BAD_VALUE:
            return None
        if piece and observe:
            self.observe(tier, len(piece), time.perf_counter() - t0)
        return piece

    def accept(self, key: str, tier: str, value: bytes, start: int, end: int | None, *,
               evict: bool = True) -> FetchedChunk | None:
        """``value``, read from ``tier`` under ``key``, as the checked chunk of tokens ``start .. end-1`` (``end``
        None: see :meth:`check`), promoted as the policy says; None when it fails its check (and, with ``evict``,
        discarded: not for a value read in pieces, which a concurrent rewrite can tear)."""
        try:
            chunk = self.check(key, value, None if end is None else end - start, tier, start)
        except Exception as err:
            if evict:
                self.discard(FetchedChunk(key, tier, start, start if end is None else end, b""), err)
            return None
        index = [t.name for t in self.tiers].index(tier)
        if self.policy.promote_on_hit and index > self.policy.promote_to:
            if call_tier(self.tiers[self.policy.promote_to], "put", key, value, default=False):
                self.count("promoted")
        self.count("hits")
        return chunk

    def check(self, key: str, value: bytes, tokens: int | None, tier: str = "", start: int = 0) -> FetchedChunk:
        """``value``, read from ``tier`` under ``key`` for the chunk of tokens ``start .. start+tokens-1``, once it
        is authentic, intact (every checksum) and the chunk asked for, of the engine's shape; raises
        :class:`CorruptDataError` (or :class:`LimitExceededError`) otherwise.  ``tokens`` None (an engine that
        learns a chunk's length from the chunk) takes the count written for ``key``, at most ``chunk_tokens``.
        Nothing is decoded; what the check parsed is kept for the decode."""
        container = unseal(self.secret, key, value)
        with ContainerFile(container, self.max_bytes(tokens)) as f:
            header = f.header
            meta = header.meta
            if f.num_chunks != 1:
                raise CorruptDataError(f"{key} holds {f.num_chunks} chunks, not one")
            if meta.get(STORE_KEY_META) != key or meta.get("model") != self.model:
                raise CorruptDataError(f"{key} holds the chunk written for {meta.get(STORE_KEY_META)!r} "
                                       f"(model {meta.get('model')!r})")
            if tokens is None:
                if not 0 < header.max_tokens <= self.chunk_tokens:
                    raise CorruptDataError(f"{key} holds {header.max_tokens} tokens, not 1 to {self.chunk_tokens}")
                tokens = header.max_tokens
            if header.max_tokens != tokens:
                raise CorruptDataError(f"{key} holds {header.max_tokens} tokens, not {tokens}")
            if self.shape is not None:
                self.shape.check(header, tokens)
            frame = f.read_frame(0)
        codecs = build_codecs(header)
        return FetchedChunk(key, tier, start, start + tokens, container, header, codecs[frame.entry.variant],
                            frame.sections)

    def discard(self, chunk: FetchedChunk, reason: BaseException) -> None:
        """Evict ``chunk`` from the tier it came from when ``reason`` says the stored value itself is bad (corrupt,
        forged, of another shape or over its size) and it is under this store's own key; any other failure (a
        calibration this machine lacks, memory, a newer format) is this machine's and leaves the entry alone."""
        if isinstance(reason, BAD_VALUE) and self.own(chunk.key):
            log.warning("chunk %s in tier %s is bad (%s); evicted", chunk.key, chunk.tier, reason)
            self.count("corrupt")
            call_tier(self.tier(chunk.tier), "delete", chunk.key, default=False)
        elif isinstance(reason, BAD_VALUE):
            log.warning("value %s in tier %s is bad (%s); treated as a miss, left stored (not this store's key)",
                        chunk.key, chunk.tier, reason)
        else:
            log.warning("chunk %s from tier %s could not be loaded here (%s: %s); treated as a miss, left stored",
                        chunk.key, chunk.tier, type(reason).__name__, reason)

    # where values are --------------------------------------------------------------------------
    def _fastest(self, op: str, keys: Sequence[str], answer: Callable[[StorageTier, int, Any], Any]) -> list[Any]:
        """For each of ``keys``, ``answer(tier, i, reply)`` from the fastest tier where it is not None, asking each
        tier once (``op`` of a list of keys) for the keys no faster tier answered."""
        out: list[Any] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, o in enumerate(out) if o is None]
            if not todo:
                break
            replies = call_tier(tier, op, [keys[i] for i in todo], default=[None] * len(todo))
            for i, reply in zip(todo, replies):
                out[i] = answer(tier, i, reply)
        return out

    def holders(self, keys: Sequence[str]) -> list[str | None]:
        """For each of ``keys``, the name of the fastest tier holding it (None: none does)."""
        return self._fastest("contains_many", keys, lambda tier, i, held: tier.name if held else None)

    def held_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, some tier holds whole: an engine's prefix hit, in its own chunks.
        Sizes come with one question per tier; a value counts only when it also ends in a container footer that
        gives its length (then the tag, with a secret), read with one ranged read of its last bytes (the whole value
        where the tier has none).  A truncated, extended or emptied value is discarded as a read would discard it, and the
        next tier's copy asked; one damaged within, or written for another key, is found when read (:meth:`check`)."""
        # Not the read's full check: per 64-token SmolLM2 page (2 shared cores), reading and checking a value costs
        # 0.9-1.1 ms (raw) and 0.26-0.32 ms (cachegen), 21-40% of a raw page's whole load (2.2-5.4 ms) and every value
        # read twice; reading its end costs 0.004 ms from memory and 0.03-0.15 ms from disk (which reads it whole),
        # against 0.001-0.002 ms for holding alone.  A value damaged within is evicted by its first read.
        ends = FOOTER.size + (TAG_BYTES if self.secret is not None else 0)
        found = self.value_sizes(keys)
        for i, key in enumerate(keys):
            for _ in self.tiers:  # each bad copy discarded, the next tier's asked
                if found[i] is None:
                    return i
                size, tier = found[i]
                end = self.read_range(tier, key, size - ends, ends, self.chunk_tokens) if size >= ends else b""
                if end is None:  # gone meanwhile, or unreadable now: a load decides
                    break
                if len(end) == ends:
                    index_offset, index_len, magic = FOOTER.unpack_from(end)
                    if magic == FOOTER_MAGIC and index_offset + index_len + ends == size:
                        break
                self.discard(FetchedChunk(key, tier, 0, self.chunk_tokens, b""), CorruptDataError(
                    f"{key} holds {size} bytes, not the length its container's footer gives (torn)"))
                found[i] = self.value_sizes([key])[0]
            else:
                return i
        return len(keys)

    def value_sizes(self, keys: Sequence[str], tokens: Sequence[int] | None = None) -> list[tuple[int, str] | None]:
        """For each of ``keys`` (a chunk of ``tokens[i]`` tokens; default ``chunk_tokens``), the size of its value and
        the fastest tier holding it (None: none does).  A value over its chunk's bound is evicted (under this
        store's own key) and counts as not held."""
        tokens = tokens or [self.chunk_tokens] * len(keys)

        def size(tier: StorageTier, i: int, n: int | None) -> tuple[int, str] | None:
            if n is None:
                return None
            if n > self.max_value_bytes(tokens[i]):
                self.discard(FetchedChunk(keys[i], tier.name, 0, tokens[i], b""), LimitExceededError(
                    f"{keys[i]} holds {n} bytes, more than a {tokens[i]}-token chunk may"))
                return None
            return int(n), tier.name

        return self._fastest("value_sizes", keys, size)

    # management --------------------------------------------------------------------------------
    def delete(self, key: str, tiers: Sequence[StorageTier] | None = None) -> int:
        """Delete ``key`` from ``tiers`` (default all); how many held it."""
        return sum(bool(call_tier(t, "delete", key, default=False)) for t in (self.tiers if tiers is None else tiers))

    def keys(self) -> list[str]:
        """This store's keys (its model and namespace) in any tier, each once, sorted."""
        return sorted({k for t in self.tiers for k in call_tier(t, "keys", default=[]) if self.own(k)})

    def copy(self, key: str, target: StorageTier) -> bool | None:
        """Copy ``key``'s value from another tier into ``target``: True when copied, False when ``target`` holds it
        already or did not take it, None when no other tier holds it."""
        if call_tier(target, "contains", key, default=False):
            return False
        for t in self.tiers:
            if t is target:
                continue
            try:
                data = call_tier(t, "get", key, self.max_value_bytes())
            except BAD_VALUE:
                continue
            if data is not None:
                return bool(call_tier(target, "put", key, data, default=False))
        return None

    def close(self) -> None:
        for t in self.tiers:
            t.close()
