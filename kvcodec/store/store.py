"""The store front: token prefixes in, KV caches out, across an ordered list of tiers."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple, Sequence

import torch

from kvcodec.api import decode, encode
from kvcodec.cache import KVCache
from kvcodec.codecs import Codec, get_codec
from kvcodec.codecs.kvtc import MissingCalibrationError
from kvcodec.errors import InvalidInputError, KVCodecError
from kvcodec.reader import Reader
from kvcodec.store.keys import chunk_bounds, chunk_hashes, format_key, namespace
from kvcodec.store.tiers import StorageTier

log = logging.getLogger(__name__)

DEFAULT_STORE_CHUNK_TOKENS = 256


class Lookup(NamedTuple):
    """``num_tokens``: how many leading tokens are stored; ``where``: the tier name of each stored chunk."""

    num_tokens: int
    where: list[str]


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


@dataclass
class FetchedChunk:
    """A chunk's container bytes, where they came from, and its token range."""

    key: str
    tier: str
    start: int
    end: int
    data: bytes


class KVStore:
    """KV caches keyed by token prefixes, chunked, encoded and spread over tiers.

    ``tiers`` are ordered fastest first.  Chunks hold ``chunk_tokens`` tokens (the last
    chunk of a sequence may be shorter); each is stored as a single-chunk kvcodec
    container encoded with ``codec`` (an id plus ``codec_options``, or a Codec), under a
    key chained over all earlier tokens (:mod:`kvcodec.store.keys`).
    """

    def __init__(self, tiers: Sequence[StorageTier], *, model: str, codec: str | Codec = "cachegen",
                 codec_options: dict[str, Any] | None = None, chunk_tokens: int = DEFAULT_STORE_CHUNK_TOKENS,
                 hash: str = "sha256", policy: PlacementPolicy | None = None,  # noqa: A002
                 save_partial: bool = True) -> None:
        if not tiers:
            raise InvalidInputError("a KVStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"tier names must be unique, got {names}")
        if chunk_tokens <= 0:
            raise InvalidInputError("chunk_tokens must be positive")
        self.tiers = list(tiers)
        self.model = model
        self.codec = codec if isinstance(codec, Codec) else get_codec(codec, **(codec_options or {}))
        self.codec = self.codec.for_cache(SimpleNamespace(model=model))  # e.g. kvtc's calibration for the model
        self.chunk_tokens = chunk_tokens
        self.hash = hash
        self.policy = policy or PlacementPolicy()
        self.save_partial = save_partial
        self.seed = namespace(model, self.codec.codec_id, self.codec.get_config(), chunk_tokens, hash)
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "promoted": 0, "demoted": 0, "puts": 0}
        self._lock = threading.Lock()
        for i, tier in enumerate(self.tiers):
            tier.on_evict = self._demoter(i)

    # keys ------------------------------------------------------------------------------------
    def keys_for(self, token_ids: Sequence[int]) -> list[tuple[str, int, int]]:
        """``(key, start, end)`` of every chunk of ``token_ids``."""
        bounds = chunk_bounds(len(token_ids), self.chunk_tokens, self.save_partial)
        digests = chunk_hashes(token_ids, self.chunk_tokens, self.seed, self.hash, self.save_partial)
        return [(format_key(self.model, d), s, e) for d, (s, e) in zip(digests, bounds)]

    def tier(self, name: str) -> StorageTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise InvalidInputError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")

    @staticmethod
    def _safe(tier: StorageTier, op: str, *args: Any, default: Any = None) -> Any:
        """Call a tier operation; a tier that raises counts as a miss (built-in tiers never raise)."""
        try:
            return getattr(tier, op)(*args)
        except Exception:
            log.warning("tier %s: %s failed", tier.name, op, exc_info=True)
            return default

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    # writing -----------------------------------------------------------------------------------
    def _put_tiers(self) -> list[StorageTier]:
        if self.policy.put_tiers is not None:
            return [self.tier(n) for n in self.policy.put_tiers]
        out = [self.tiers[0]]
        shared = [i for i, t in enumerate(self.tiers) if t.name in self.policy.shared]
        if shared:
            out += [t for t in self.tiers[min(shared):] if t is not self.tiers[0]]
        return out

    def put(self, token_ids: Sequence[int], kv: KVCache, *, replicate: bool = True) -> int:
        """Store the chunks of ``kv`` (computed over ``token_ids``) that are not stored yet.

        Returns the number of chunks written.  Every layer must hold all ``len(token_ids)``
        tokens (sliding-window layers cannot be split into prefix chunks).  With ``replicate``
        a chunk goes to every put tier that lacks it; without, a chunk that any tier holds is
        left as it is (no encoding: for callers that just loaded part of ``kv`` from the store).
        """
        token_ids = [int(t) for t in token_ids]
        if any(l.keys.shape[1] != len(token_ids) for l in kv.layers):
            raise InvalidInputError(f"every layer must hold {len(token_ids)} tokens, one per token id")
        if kv.model is not None and kv.model != self.model:
            raise InvalidInputError(f"the cache is of model {kv.model!r}, the store of {self.model!r}")
        targets = self._put_tiers()
        written = 0
        for key, s, e in self.keys_for(token_ids):
            if not replicate and any(self._safe(t, "contains", key, default=False) for t in self.tiers):
                continue
            missing = [t for t in targets if not self._safe(t, "contains", key, default=False)]
            if not missing:
                continue
            positions = kv.positions[s:e] if kv.positions is not None else (
                range(s, e) if self.codec.uses_positions else None)
            part = KVCache([(l.keys[:, s:e], l.values[:, s:e]) for l in kv.layers], model=self.model,
                           token_ids=token_ids[s:e], rope=kv.rope, positions=positions)
            blob = encode(part, self.codec, chunk_tokens=e - s)
            if any([self._safe(t, "put", key, blob, default=False) for t in missing]):
                written += 1
        if written:
            self._hold_calibration(targets)
        self._count("puts", written)
        return written

    # A codec that decodes with a calibration file (kvtc) gets it stored once, by hash, beside the chunks, so a
    # store on another machine that shares the tiers can decode them.
    def _calibration_key(self) -> str | None:
        digest = self.codec.get_config().get("calibration") if self.codec.codec_id == "kvtc" else None
        return None if digest is None else f"kvcodec-calibration@{digest}"

    def _hold_calibration(self, targets: Sequence[StorageTier]) -> None:
        key = self._calibration_key()
        if key is None:
            return
        for t in targets:
            if not self._safe(t, "contains", key, default=False):
                self._safe(t, "put", key, self.codec.calibration_data().to_bytes())

    def _fetch_calibration(self) -> None:
        """Make the codec's calibration findable, from the tiers if this machine does not have it."""
        from kvcodec.codecs.kvtc import Calibration, register_calibration

        key = self._calibration_key()
        if key is None:
            return
        try:
            self.codec.calibration_data()
            return
        except MissingCalibrationError:
            pass
        digest = key.split("@", 1)[1]
        for t in self.tiers:
            data = self._safe(t, "get", key)
            if data is not None:
                try:
                    register_calibration(Calibration.from_bytes(bytes(data), digest))
                    return
                except KVCodecError:
                    log.warning("tier %s holds a damaged calibration %s", t.name, digest)

    def _demoter(self, index: int):
        def demote(key: str, value: bytes) -> None:
            if not self.policy.demote_on_evict:
                return
            for lower in self.tiers[index + 1:]:
                if self._safe(lower, "contains", key, default=False):
                    return
                if self._safe(lower, "put", key, value, default=False):
                    self._count("demoted")
                    return
        return demote

    # reading -----------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int]) -> Lookup:
        """How many leading tokens of ``token_ids`` are stored, and in which tier each chunk is."""
        n, where = 0, []
        for key, _, e in self.keys_for(token_ids):
            tier = next((t for t in self.tiers if self._safe(t, "contains", key, default=False)), None)
            if tier is None:
                break
            n, where = e, where + [tier.name]
        return Lookup(n, where)

    def fetch(self, token_ids: Sequence[int], *, verify: bool = True) -> list[FetchedChunk]:
        """The container bytes of the stored prefix of ``token_ids``, chunk by chunk.

        Each chunk comes from the fastest tier that holds it intact: with ``verify`` every
        checksum is checked (no decoding) and the chunk must be the one asked for; a damaged
        or wrong chunk is deleted from that tier and the next tier is tried.  The prefix
        stops at the first chunk no tier holds intact (a miss: the caller recomputes).
        Hits in slower tiers are promoted as the policy says.
        """
        token_ids = [int(t) for t in token_ids]
        out: list[FetchedChunk] = []
        for key, s, e in self.keys_for(token_ids):
            found = None
            for i, tier in enumerate(self.tiers):
                data = self._safe(tier, "get", key)
                if data is None:
                    continue
                if verify and not self._intact(data, token_ids[s:e]):
                    log.warning("chunk %s in tier %s is damaged; evicted", key, tier.name)
                    self._count("corrupt")
                    self._safe(tier, "delete", key)
                    continue
                found = FetchedChunk(key, tier.name, s, e, data)
                if self.policy.promote_on_hit and i > self.policy.promote_to:
                    if self._safe(self.tiers[self.policy.promote_to], "put", key, data, default=False):
                        self._count("promoted")
                break
            if found is None:
                self._count("misses")
                break
            self._count("hits")
            out.append(found)
        return out

    def _intact(self, data: bytes, token_ids: list[int]) -> bool:
        try:
            with Reader(data) as r:
                if r.num_chunks != 1 or r.header.meta.get("token_ids") != token_ids:
                    return False
                if r.header.meta.get("model") != self.model:
                    return False
                r._container.read_frame(0)  # checks every section's checksum
            return True
        except Exception:
            return False

    def get(self, token_ids: Sequence[int], *, device: torch.device | str | None = None) -> KVCache | None:
        """The decoded KV of the stored prefix of ``token_ids`` (None when nothing is stored).

        A chunk that fails to decode is evicted from the tier it came from, and the prefix
        ends before it (the caller recomputes from there).
        """
        token_ids = [int(t) for t in token_ids]
        self._fetch_calibration()
        parts = []
        for chunk in self.fetch(token_ids):
            try:
                parts.append(decode(chunk.data, device=device))
            except MissingCalibrationError:
                raise  # the chunk is fine; this machine lacks what decodes it
            except Exception:
                log.warning("chunk %s from tier %s failed to decode; evicted", chunk.key, chunk.tier, exc_info=True)
                self._count("corrupt")
                self._safe(self.tier(chunk.tier), "delete", chunk.key)
                break
        if not parts:
            return None
        return concat(parts, model=self.model, token_ids=token_ids[: sum(p.num_tokens for p in parts)])

    # management --------------------------------------------------------------------------------
    def evict(self, token_ids: Sequence[int], *, tiers: Sequence[str] | None = None) -> int:
        """Delete the chunks of ``token_ids`` from ``tiers`` (default all); returns deletions."""
        targets = self.tiers if tiers is None else [self.tier(n) for n in tiers]
        return sum(bool(self._safe(t, "delete", key, default=False)) for key, _, _ in self.keys_for(token_ids) for t in targets)

    def promote(self, token_ids: Sequence[int], *, to: str | None = None) -> int:
        """Copy the stored chunks of ``token_ids`` into tier ``to`` (default the fastest); returns copies."""
        target = self.tiers[0] if to is None else self.tier(to)
        n = 0
        for key, _, _ in self.keys_for(token_ids):
            if self._safe(target, "contains", key, default=False):
                continue
            data = next((d for t in self.tiers if t is not target and (d := self._safe(t, "get", key)) is not None), None)
            if data is None:
                break
            if self._safe(target, "put", key, data, default=False):
                n += 1
        self._count("promoted", n)
        return n

    def close(self) -> None:
        for t in self.tiers:
            t.close()


def concat(parts: Sequence[KVCache], **meta: Any) -> KVCache:
    """Join caches of consecutive token ranges along the token axis."""
    if len(parts) == 1:
        layers = [(l.keys, l.values) for l in parts[0].layers]
    else:
        layers = [(torch.cat([p.layers[i].keys for p in parts], 1), torch.cat([p.layers[i].values for p in parts], 1))
                  for i in range(parts[0].num_layers)]
    rope = parts[0].rope
    return KVCache(layers, rope=rope, **meta)
