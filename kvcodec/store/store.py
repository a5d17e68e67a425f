"""The store front: token prefixes in, KV caches out, across an ordered list of tiers.

A stored value is a single-chunk container whose header names the key it was written for (``meta.store_key``),
followed, when the store has a secret, by an authentication tag (:mod:`kvcodec.store.auth`).  Before a chunk is
served it must be intact (every checksum), authentic (with a secret), the chunk asked for (its key, model and
token count) and, when the store knows what its engine holds (``shape``), of exactly that shape and dtype; and a
decode never takes more than that shape's bytes.  A value failing any of these is *corrupt*: it is evicted from
the tier it came from.  Anything else that stops a load on this machine (a missing kvtc calibration, memory, a
newer format) is a miss that leaves the shared entry alone.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple, Sequence

import torch

from kvcodec.adapt import BandwidthEstimator
from kvcodec.api import encode
from kvcodec.cache import KVCache
from kvcodec.codecs import Codec, get_codec
from kvcodec.container import ContainerFile
from kvcodec.errors import CorruptDataError, InvalidInputError, KVCodecError, LimitExceededError
from kvcodec.reader import build_codecs
from kvcodec.store.auth import check_secret, seal, unseal
from kvcodec.store.chunks import ChunkShape, FetchedChunk
from kvcodec.store.keys import CacheIdentity, chunk_bounds, chunk_hashes, format_key, hasher, namespace, salted
from kvcodec.store.load import DenseSink, PrefixLoad, decode_chunk_into
from kvcodec.store.plan import Contention
from kvcodec.store.tiers import StorageTier

log = logging.getLogger(__name__)

DEFAULT_STORE_CHUNK_TOKENS = 256
# Without a known shape a chunk's decode may still not take more than this (the header limits alone allow one
# layer tens of gigabytes); a 256-token chunk of a 70B-class model in float16 is 80 MiB.
DEFAULT_MAX_CHUNK_BYTES = 256 << 20
STORE_KEY_META = "store_key"


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


class KVStore:
    """KV caches keyed by token prefixes, chunked, encoded and spread over tiers.

    ``tiers`` are ordered fastest first.  Chunks hold ``chunk_tokens`` tokens (the last
    chunk of a sequence may be shorter); each is stored as a single-chunk kvcodec
    container encoded with ``codec`` (an id plus ``codec_options``, or a Codec), under a
    key chained over all earlier tokens and seeded by ``model``, ``identity`` and the codec
    (:mod:`kvcodec.store.keys`).

    ``secret`` (16 bytes or more, shared by the deployment) keys the chain with HMAC and authenticates every
    value (:mod:`kvcodec.store.auth`); without it, whoever can write a tier must be trusted like the model
    weights.  ``shape`` (:class:`ChunkShape`) is what the engine holds: chunks of any other shape are corrupt,
    and a decode takes at most that shape's bytes; without it a decode takes at most ``max_chunk_bytes``.
    """

    def __init__(self, tiers: Sequence[StorageTier], *, model: str,
                 codec: str | Codec | Sequence[str | Codec] = "cachegen",
                 codec_options: dict[str, Any] | None = None, chunk_tokens: int = DEFAULT_STORE_CHUNK_TOKENS,
                 hash: str = "sha256", policy: PlacementPolicy | None = None,  # noqa: A002
                 save_partial: bool = True, identity: CacheIdentity | None = None, secret: bytes | str | None = None,
                 shape: ChunkShape | None = None, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> None:
        if not tiers:
            raise InvalidInputError("a KVStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"tier names must be unique, got {names}")
        if chunk_tokens <= 0:
            raise InvalidInputError("chunk_tokens must be positive")
        if not (isinstance(max_chunk_bytes, int) and max_chunk_bytes > 0):
            raise InvalidInputError(f"max_chunk_bytes must be a positive integer, not {max_chunk_bytes!r}")
        self.tiers = list(tiers)
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.hash = hash
        self.policy = policy or PlacementPolicy()
        self.save_partial = save_partial
        self.identity = identity or CacheIdentity()
        self.secret = check_secret(secret)
        self.shape = shape
        self.max_chunk_bytes = max_chunk_bytes
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "promoted": 0, "demoted": 0, "puts": 0}
        # each tier's read throughput, from this store's own reads (what load-time adaptation plans with)
        self.links = {t.name: BandwidthEstimator() for t in self.tiers}
        # how much a decode slows each tier's reads here (loads from both ends weigh it)
        self.contention = {t.name: Contention() for t in self.tiers}
        # each codec's decode rate in tokens per second, from this store's own loads (by repr(codec))
        self.decode_rates: dict[str, BandwidthEstimator] = {}
        self._lock = threading.Lock()
        self.use_codec(codec, codec_options)
        for i, tier in enumerate(self.tiers):
            tier.on_evict = self._demoter(i)

    def use_codec(self, codec: str | Codec | Sequence[str | Codec], codec_options: dict[str, Any] | None = None) -> None:
        """Save and load with ``codec`` (one, or variants smallest first) from now on.  Chunks saved with another
        codec stay stored under their own keys (a codec is part of every key), so loads and saves that race with
        the switch miss, never mix."""
        variants = _variants(codec, codec_options, self.model)
        seeds = [namespace(self.model, c.codec_id, c.get_config(), self.chunk_tokens, self.hash, self.identity,
                           self.secret) for c in variants]
        with self._lock:
            self._state = (variants, seeds)

    @property
    def variants(self) -> list[Codec]:
        """The codecs every chunk is saved in, smallest first (one unless the store was given a list)."""
        return self._state[0]

    @property
    def codec(self) -> Codec:
        """The best (last) variant."""
        return self._state[0][-1]

    @property
    def seed(self) -> bytes:
        return self._state[1][-1]

    def decode_rate(self, codec: Codec) -> BandwidthEstimator:
        """``codec``'s decode rate in tokens per second, from this store's own loads.  Unmeasured, a codec is taken
        to decode for free, so that the first load that could use it does, and measures it."""
        with self._lock:
            return self.decode_rates.setdefault(repr(codec), BandwidthEstimator(prior_bps=1e12))

    # keys ------------------------------------------------------------------------------------
    def keys_for(self, token_ids: Sequence[int], *, salt: str | bytes | None = None,
                 variant: int = -1) -> list[tuple[str, int, int]]:
        """``(key, start, end)`` of every chunk of ``token_ids`` in ``variant`` (an index into :attr:`variants`;
        default the best); ``salt`` (vLLM's ``cache_salt``) keeps a request's chunks apart from those of requests
        without the same salt."""
        return self._keys(token_ids, salt, self._state[1][variant])

    def _keys(self, token_ids: Sequence[int], salt: str | bytes | None, seed: bytes) -> list[tuple[str, int, int]]:
        bounds = chunk_bounds(len(token_ids), self.chunk_tokens, self.save_partial)
        seed = salted(seed, salt, self.hash, self.secret)
        digests = chunk_hashes(token_ids, self.chunk_tokens, seed, self.hash, self.save_partial, self.secret)
        return [(format_key(self.model, d, self.identity.namespace), s, e) for d, (s, e) in zip(digests, bounds)]

    def variant_keys(self, token_ids: Sequence[int], *, salt: str | bytes | None = None
                     ) -> list[tuple[int, int, list[str]]]:
        """``(start, end, keys)`` of every chunk of ``token_ids``: its key in each of :attr:`variants`."""
        return self._variant_keys(token_ids, salt, self._state[1])

    def _variant_keys(self, token_ids: Sequence[int], salt: str | bytes | None,
                      seeds: Sequence[bytes]) -> list[tuple[int, int, list[str]]]:
        per_variant = [self._keys(token_ids, salt, seed) for seed in seeds]
        return [(s, e, [keys[i][0] for keys in per_variant]) for i, (_, s, e) in enumerate(per_variant[0])]

    def engine_key(self, name: str, context: bytes) -> str:
        """The tier key of a chunk that an engine names itself (SGLang's page hash, LMCache's chunk key), which
        already chains its prefix: ``name`` hashed with the store's namespace (model, codec and its settings, chunk
        size, identity; HMAC under a secret), so that caches of another model, codec or rank never meet.
        ``context`` (one per engine contract, e.g. ``b"sglang-hicache/1\\0"``) keeps two engines' names apart."""
        digest = hasher(self.hash, self.secret)(self.seed + context + str(name).encode())
        return format_key(self.model, digest, self.identity.namespace)

    def tier(self, name: str) -> StorageTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise InvalidInputError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")

    @staticmethod
    def call_tier(tier: StorageTier, op: str, *args: Any, default: Any = None) -> Any:
        """Call a tier operation; a tier that raises counts as a miss (built-in tiers never raise), with a warning."""
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

    def put(self, token_ids: Sequence[int], kv: KVCache, *, replicate: bool = True,
            salt: str | bytes | None = None) -> int:
        """Store the chunks of ``kv`` (computed over ``token_ids``) that are not stored yet.

        Returns the number of chunks written.  Every layer must hold all ``len(token_ids)``
        tokens (sliding-window layers cannot be split into prefix chunks).  With ``replicate``
        a chunk goes to every put tier that lacks it; without, a chunk that any tier holds is
        left as it is (no encoding: for callers that just loaded part of ``kv`` from the store).
        The token ids themselves are not stored: a chunk names its key instead.
        """
        token_ids = [int(t) for t in token_ids]
        if any(l.keys.shape[1] != len(token_ids) for l in kv.layers):
            raise InvalidInputError(f"every layer must hold {len(token_ids)} tokens, one per token id")
        self._check_cache(kv)
        targets = self._put_tiers()
        written = 0
        variants, seeds = self._state  # one snapshot: a codec switch meanwhile cannot pair a key with another codec
        for s, e, keys in self._variant_keys(token_ids, salt, seeds):
            wrote = False
            for codec, key in zip(variants, keys):
                if not replicate and any(self.call_tier(t, "contains", key, default=False) for t in self.tiers):
                    continue
                positions = kv.positions[s:e] if kv.positions is not None else (
                    range(s, e) if codec.uses_positions else None)
                part = KVCache([(l.keys[:, s:e], l.values[:, s:e]) for l in kv.layers], model=self.model,
                               rope=kv.rope, positions=positions)
                wrote = self._write(key, codec, part, targets) > 0 or wrote
            written += wrote
        if written:
            self._hold_side_data(targets)
        self._count("puts", written)
        return written

    def put_chunk(self, key: str, kv: KVCache) -> int:
        """Store ``kv``, one chunk of at most ``chunk_tokens`` tokens, under ``key`` (an :meth:`engine_key`) in the
        best variant, in every put tier that lacks it.  Returns the stored value's size in bytes (0: every put tier
        held it already, or none took it)."""
        if not 0 < kv.num_tokens <= self.chunk_tokens:
            raise InvalidInputError(f"a chunk holds 1 to {self.chunk_tokens} tokens, not {kv.num_tokens}")
        self._check_cache(kv)
        targets = self._put_tiers()
        size = self._write(key, self.codec, kv, targets)
        if size:
            self._hold_side_data(targets)
            self._count("puts")
        return size

    def _check_cache(self, kv: KVCache) -> None:
        if kv.model is not None and kv.model != self.model:
            raise InvalidInputError(f"the cache is of model {kv.model!r}, the store of {self.model!r}")
        if self.shape is not None and ChunkShape.of(kv) != self.shape:
            raise InvalidInputError(f"the cache is of shape {ChunkShape.of(kv)}, the store's engine {self.shape}")

    def _write(self, key: str, codec: Codec, part: KVCache, targets: Sequence[StorageTier]) -> int:
        """Encode ``part`` (one chunk) once and put it under ``key`` in each of ``targets`` that lacks it: the
        value's size, or 0 when none needed or took it."""
        missing = [t for t in targets if not self.call_tier(t, "contains", key, default=False)]
        if not missing:
            return 0
        value = seal(self.secret, key, encode(part, codec, chunk_tokens=part.num_tokens, meta={STORE_KEY_META: key}))
        return len(value) if any([self.call_tier(t, "put", key, value, default=False) for t in missing]) else 0

    # A codec that decodes with side data (kvtc's calibration) gets it stored once, by name, beside the chunks, so
    # a store on another machine that shares the tiers can decode them.
    def _hold_side_data(self, targets: Sequence[StorageTier]) -> None:
        for codec in self.variants:
            key = codec.side_data_name()
            if key is None:
                continue
            for t in targets:
                if not self.call_tier(t, "contains", key, default=False):
                    self.call_tier(t, "put", key, codec.side_data())

    def fetch_side_data(self) -> None:
        """Make what the variants need beyond their bytes (kvtc's calibration) available here, from the tiers if
        this machine lacks it."""
        for codec in self.variants:
            key = codec.side_data_name()
            if key is None or codec.has_side_data():
                continue
            for t in self.tiers:
                data = self.call_tier(t, "get", key)
                if data is not None:
                    try:
                        codec.install_side_data(data)
                        break
                    except KVCodecError:
                        log.warning("tier %s holds damaged side data %s", t.name, key)

    def _demoter(self, index: int):
        def demote(key: str, value: bytes) -> None:
            if not self.policy.demote_on_evict:
                return
            for lower in self.tiers[index + 1:]:
                if self.call_tier(lower, "contains", key, default=False):
                    return
                if self.call_tier(lower, "put", key, value, default=False):
                    self._count("demoted")
                    return
        return demote

    # reading -----------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], *, salt: str | bytes | None = None) -> Lookup:
        """How many leading tokens of ``token_ids`` are stored (in any variant), and in which tier each chunk is."""
        chunks = self.variant_keys(token_ids, salt=salt)
        holder = self.holders([k for _, _, ks in chunks for k in ks])
        n, where, v = 0, [], len(self.variants)
        for c, (_, e, _) in enumerate(chunks):
            name = next((h for h in holder[c * v:(c + 1) * v][::-1] if h is not None), None)
            if name is None:
                break
            n, where = e, where + [name]
        return Lookup(n, where)

    def holders(self, keys: Sequence[str]) -> list[str | None]:
        """For each of ``keys``, the name of the fastest tier holding it (None: none does), asking each tier once
        for the keys no faster tier holds."""
        holder: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, h in enumerate(holder) if h is None]
            if not todo:
                break
            held = self.call_tier(tier, "contains_many", [keys[i] for i in todo], default=[False] * len(todo))
            for i, yes in zip(todo, held):
                if yes:
                    holder[i] = tier.name
        return holder

    def held_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, some tier holds: an engine's prefix hit, in its own chunks."""
        held = [h is not None for h in self.holders(keys)]
        return held.index(False) if False in held else len(held)

    def variant_sizes(self, keys: Sequence[str]) -> list[tuple[int, str] | None]:
        """For each of ``keys``, the size of its value and the fastest tier holding it (None: none does), asking
        each tier once for the keys no faster tier holds."""
        out: list[tuple[int, str] | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, o in enumerate(out) if o is None]
            if not todo:
                break
            sizes = self.call_tier(tier, "value_sizes", [keys[i] for i in todo], default=[None] * len(todo))
            for i, n in zip(todo, sizes):
                if n is not None:
                    out[i] = (int(n), tier.name)
        return out

    def max_bytes(self, tokens: int) -> int:
        """The most a decode of a ``tokens``-token chunk may produce (the engine's shape, or ``max_chunk_bytes``)."""
        return self.shape.output_bytes(tokens) if self.shape is not None else self.max_chunk_bytes

    def check_chunk(self, key: str, value: bytes, tokens: int | None, tier: str = "", start: int = 0) -> FetchedChunk:
        """``value``, read from ``tier`` under ``key`` for the chunk of tokens ``start .. start+tokens-1``, once it
        is authentic, intact (every checksum) and the chunk asked for, of the engine's shape; raises
        :class:`CorruptDataError` (or :class:`LimitExceededError`) otherwise.  ``tokens`` None (an engine that
        learns a chunk's length from the chunk) takes the count written for ``key``, at most ``chunk_tokens``.
        Nothing is decoded; what the check parsed is kept for the decode."""
        container = unseal(self.secret, key, value)
        with ContainerFile(container, self.max_bytes(tokens or self.chunk_tokens)) as f:
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
        forged, of another shape or over its size); any other failure (a calibration this machine lacks, memory,
        a newer format) is this machine's and leaves the shared entry alone."""
        if isinstance(reason, (CorruptDataError, LimitExceededError)):
            log.warning("chunk %s in tier %s is bad (%s); evicted", chunk.key, chunk.tier, reason)
            self._count("corrupt")
            self.call_tier(self.tier(chunk.tier), "delete", chunk.key)
        else:
            log.warning("chunk %s from tier %s could not be loaded here (%s: %s); treated as a miss, left stored",
                        chunk.key, chunk.tier, type(reason).__name__, reason)

    def read_chunk(self, key: str, start: int = 0, end: int | None = None) -> FetchedChunk | None:
        """The chunk of tokens ``start .. end-1`` stored under ``key`` (``end`` None: as many as were written for it),
        from the fastest tier that holds it intact (:meth:`check_chunk`); a bad value is evicted from its tier
        (:meth:`discard`) and the next tier is tried.  A hit in a slower tier is promoted as the policy says.  None
        when no tier holds it intact."""
        for tier in self.tiers:
            t0 = time.perf_counter()
            value = self.call_tier(tier, "get", key)
            if value is None:
                continue
            self.links[tier.name].observe(len(value), time.perf_counter() - t0)
            chunk = self.accept(key, tier.name, value, start, end)
            if chunk is not None:
                return chunk
        self._count("misses")
        return None

    def accept(self, key: str, tier: str, value: bytes, start: int, end: int | None, *,
               evict: bool = True) -> FetchedChunk | None:
        """``value``, read from ``tier`` under ``key``, as the checked chunk of tokens ``start .. end-1`` (``end``
        None: see :meth:`check_chunk`), promoted as the policy says; None when it fails its check (and, with
        ``evict``, evicted when the value itself is bad: not for a value read in pieces, which a concurrent rewrite
        can tear)."""
        try:
            chunk = self.check_chunk(key, value, None if end is None else end - start, tier, start)
        except Exception as err:
            if evict:
                self.discard(FetchedChunk(key, tier, start, start if end is None else end, b""), err)
            return None
        index = [t.name for t in self.tiers].index(tier)
        if self.policy.promote_on_hit and index > self.policy.promote_to:
            if self.call_tier(self.tiers[self.policy.promote_to], "put", key, value, default=False):
                self._count("promoted")
        self._count("hits")
        return chunk

    def fetch(self, token_ids: Sequence[int], *, salt: str | bytes | None = None) -> list[FetchedChunk]:
        """The checked chunks of the stored prefix of ``token_ids``, as :meth:`read_chunk` reads them, up to the
        first chunk no tier holds intact (a miss: the caller recomputes from there).  Engines load through
        :class:`kvcodec.store.load.PrefixLoad`, which streams these reads into their memory."""
        out: list[FetchedChunk] = []
        for key, s, e in self.keys_for([int(t) for t in token_ids], salt=salt):
            chunk = self.read_chunk(key, s, e)
            if chunk is None:
                break
            out.append(chunk)
        return out

    def decode_chunk(self, chunk: FetchedChunk, *, device: torch.device | str | None = None) -> KVCache:
        """Decode a fetched chunk within :meth:`max_bytes`."""
        sink = DenseSink(device=device)
        decode_chunk_into(self, chunk, sink, chunk.start, chunk.end, device=device)
        return sink.cache(model=self.model)

    def load_chunk(self, key: str, tokens: int | None = None, *,
                   device: torch.device | str | None = None) -> KVCache | None:
        """The chunk stored under ``key`` (an :meth:`engine_key`), read as :meth:`read_chunk` reads it and decoded:
        for engines that ask for their chunks one at a time.  ``tokens`` None takes the count written for it.  None
        is a miss: no tier holds it intact, or it did not decode (then :meth:`discard` says whether it stays)."""
        chunk = self.read_chunk(key, 0, tokens)
        if chunk is None:
            return None
        try:
            return self.decode_chunk(chunk, device=device)
        except Exception as err:
            self.discard(chunk, err)
            self._count("misses")
            return None

    def get(self, token_ids: Sequence[int], *, device: torch.device | str | None = None,
            salt: str | bytes | None = None) -> KVCache | None:
        """The decoded KV of the stored prefix of ``token_ids`` (None when nothing is stored).

        The prefix ends before the first chunk that is missing or does not decode (the caller recomputes from
        there); a bad chunk is evicted, as :meth:`discard` says.  Chunks must agree in shape with the first (or
        with ``shape``).
        """
        token_ids = [int(t) for t in token_ids]
        sink = DenseSink(device=device)
        result = PrefixLoad(self, token_ids, sink, salt=salt, device=device).start().finish()
        if result.loaded_end == 0:
            return None
        return sink.cache(model=self.model, token_ids=token_ids[:result.loaded_end])

    # management --------------------------------------------------------------------------------
    def evict(self, token_ids: Sequence[int], *, tiers: Sequence[str] | None = None,
              salt: str | bytes | None = None) -> int:
        """Delete the chunks of ``token_ids`` from ``tiers`` (default all); returns deletions."""
        targets = self.tiers if tiers is None else [self.tier(n) for n in tiers]
        return sum(bool(self.call_tier(t, "delete", key, default=False))
                   for key, _, _ in self.keys_for(token_ids, salt=salt) for t in targets)

    def promote(self, token_ids: Sequence[int], *, to: str | None = None, salt: str | bytes | None = None) -> int:
        """Copy the stored chunks of ``token_ids`` into tier ``to`` (default the fastest); returns copies."""
        target = self.tiers[0] if to is None else self.tier(to)
        n = 0
        for key, _, _ in self.keys_for(token_ids, salt=salt):
            if self.call_tier(target, "contains", key, default=False):
                continue
            data = next((d for t in self.tiers if t is not target and (d := self.call_tier(t, "get", key)) is not None), None)
            if data is None:
                break
            if self.call_tier(target, "put", key, data, default=False):
                n += 1
        self._count("promoted", n)
        return n

    def close(self) -> None:
        for t in self.tiers:
            t.close()


def _variants(codec: str | Codec | Sequence[str | Codec], options: dict[str, Any] | None, model: str) -> list[Codec]:
    """The store's codecs: one, or a list of variants (smallest first), each resolved for ``model`` (e.g. kvtc's
    calibration)."""
    from kvcodec.codecs.registry import codec_from_spec

    if isinstance(codec, (str, Codec)):
        codecs = [codec if isinstance(codec, Codec) else get_codec(codec, **(options or {}))]
    else:
        codecs = [c if isinstance(c, Codec) else codec_from_spec(str(c)) for c in codec]
        if not codecs or options:
            raise InvalidInputError("a list of codec variants needs at least one, each with its options in its spec "
                                    "(\"kvtc:level=0\"), and no codec_options")
    out = [c.for_cache(SimpleNamespace(model=model)) for c in codecs]
    if len({(c.codec_id, repr(sorted(c.get_config().items()))) for c in out}) != len(out):
        raise InvalidInputError(f"the codec variants repeat one: {[repr(c) for c in out]}")
    return out


def concat(parts: Sequence[KVCache], **meta: Any) -> KVCache:
    """Join caches of consecutive token ranges along the token axis."""
    if len(parts) == 1:
        layers = [(l.keys, l.values) for l in parts[0].layers]
    else:
        layers = [(torch.cat([p.layers[i].keys for p in parts], 1), torch.cat([p.layers[i].values for p in parts], 1))
                  for i in range(parts[0].num_layers)]
    rope = parts[0].rope
    return KVCache(layers, rope=rope, **meta)
