"""The store front: token prefixes in, KV caches out, across an ordered list of tiers.

:class:`KVStore` is a facade over the store's parts: keys (:mod:`kvcodec.store.keys`), a chunk source that reads,
checks and evicts (:mod:`kvcodec.store.source`, whose docstring says what a chunk must pass to be served), the
store's own measurements (:mod:`kvcodec.store.telemetry`) and the load that streams chunks into an engine's memory
(:mod:`kvcodec.store.load`, planned by :mod:`kvcodec.store.plan`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Sequence

import torch

from kvcodec.api import encode
from kvcodec.cache import KVCache
from kvcodec.codecs import Codec, get_codec
from kvcodec.errors import InvalidInputError
from kvcodec.layouts.sinks import DenseSink, PagedSink
from kvcodec.store.auth import check_secret, seal
from kvcodec.store.chunks import ChunkShape, FetchedChunk
from kvcodec.store.identity import CacheIdentity
from kvcodec.store.keys import chunk_bounds, chunk_hashes, format_key, hasher, namespace, salted
from kvcodec.store.load import DEFAULT_PREFETCH_BYTES, PrefixLoad, decode_chunk_into
from kvcodec.store.plan import LoadPlanner, Option
from kvcodec.store.source import DEFAULT_MAX_CHUNK_BYTES, STORE_KEY_META, ChunkSource, PlacementPolicy
from kvcodec.store.telemetry import Telemetry
from kvcodec.store.telemetry_file import TelemetryFile
from kvcodec.store.tiers import StorageTier

log = logging.getLogger(__name__)

# The key a chunk timed by KVStore.measure_decodes is coded under (it is never stored).
MEASURE_KEY = "kvcodec-measure-decode"

DEFAULT_STORE_CHUNK_TOKENS = 256
VARIANT_CONTEXT = b"variant-of\0"  # a variant's key of an engine's chunk (KVStore.chunk_keys)


class Lookup(NamedTuple):
    """``num_tokens``: how many leading tokens are stored (in any variant); ``where``: the tier name of each stored
    chunk; ``in_every_variant``: how many leading tokens are stored in every variant (a put of them writes
    nothing)."""

    num_tokens: int
    where: list[str]
    in_every_variant: int = 0


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
    and a read and a decode take at most that shape's bytes; without it at most ``max_chunk_bytes``.
    ``telemetry_file``: a file that keeps the store's estimates of its links and decode rates from one process to
    the next (:mod:`kvcodec.store.telemetry_file`); None (the default) keeps them in this process only.
    """

    def __init__(self, tiers: Sequence[StorageTier], *, model: str,
                 codec: str | Codec | Sequence[str | Codec] = "cachegen",
                 codec_options: dict[str, Any] | None = None, chunk_tokens: int = DEFAULT_STORE_CHUNK_TOKENS,
                 hash: str = "sha256", policy: PlacementPolicy | None = None,  # noqa: A002
                 save_partial: bool = True, identity: CacheIdentity | None = None, secret: bytes | str | None = None,
                 shape: ChunkShape | None = None, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 telemetry_file: str | os.PathLike[str] | None = None) -> None:
        if chunk_tokens <= 0:
            raise InvalidInputError("chunk_tokens must be positive")
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.hash = hash
        self.save_partial = save_partial
        self.identity = identity or CacheIdentity()
        self.secret = check_secret(secret)
        self.telemetry = Telemetry(t.name for t in tiers)
        self.telemetry_file = None if telemetry_file is None else TelemetryFile(
            telemetry_file, self.telemetry, {t.name: repr(t) for t in tiers}).start()
        self.source = ChunkSource(tiers, model=model, namespace=self.identity.namespace, secret=self.secret,
                                  shape=shape, chunk_tokens=chunk_tokens, max_chunk_bytes=max_chunk_bytes,
                                  policy=policy, observe=self.telemetry.observe_read)
        self._lock = threading.Lock()
        self._chunk_loads: dict[str, int] = {}
        self.use_codec(codec, codec_options)

    @property
    def tiers(self) -> list[StorageTier]:
        return self.source.tiers

    @property
    def shape(self) -> ChunkShape | None:
        return self.source.shape

    @shape.setter
    def shape(self, shape: ChunkShape | None) -> None:
        # a hook that knows its model gives a store made without a shape that model's (the transformers hook)
        self.source.shape = shape

    @property
    def policy(self) -> PlacementPolicy:
        return self.source.policy

    @property
    def max_chunk_bytes(self) -> int:
        return self.source.max_chunk_bytes

    @property
    def stats(self) -> dict[str, int]:
        """Counts of hits, misses, bad values evicted (``corrupt``), promotions, demotions, chunks put and the bytes
        of their values (``put_bytes``); with several variants, an engine's chunks loaded in each
        (``chunk_loads_<codec id>``, :meth:`load_chunk`)."""
        return {**self.source.stats, **self._chunk_loads} if self._chunk_loads else self.source.stats

    def use_codec(self, codec: str | Codec | Sequence[str | Codec], codec_options: dict[str, Any] | None = None) -> None:
        """Save and load with ``codec`` (one, or variants smallest first) from now on.  Chunks saved with another
        codec stay stored under their own keys (a codec is part of every key), so loads and saves that race with
        the switch miss, never mix."""
        variants = _variants(codec, codec_options, self.model, self.identity.model_digest)
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

    # keys ------------------------------------------------------------------------------------
    def put_end(self, num_tokens: int) -> int:
        """How many leading tokens of a ``num_tokens`` sequence a :meth:`put` stores: all, or with ``save_partial``
        off only its whole chunks.  A put writes nothing where :meth:`lookup`'s ``in_every_variant`` reaches it."""
        bounds = chunk_bounds(num_tokens, self.chunk_tokens, self.save_partial)
        return bounds[-1][1] if bounds else 0

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

    def chunk_keys(self, key: str) -> list[str]:
        """The key of an engine's chunk ``key`` (an :meth:`engine_key`) in each of :attr:`variants`, smallest first:
        the best variant's is ``key`` itself (so a store of one variant keys as it always did), another's is ``key``
        hashed with that variant's namespace, as a prefix chunk's key in each variant is seeded by its own."""
        return self._chunk_keys(key, self._state[1])

    def _chunk_keys(self, key: str, seeds: Sequence[bytes]) -> list[str]:
        h = hasher(self.hash, self.secret)
        return [format_key(self.model, h(seed + VARIANT_CONTEXT + key.encode()), self.identity.namespace)
                for seed in seeds[:-1]] + [key]

    def tier(self, name: str) -> StorageTier:
        return self.source.tier(name)

    # writing -----------------------------------------------------------------------------------
    def put(self, token_ids: Sequence[int], kv: KVCache, *, replicate: bool = True,
            salt: str | bytes | None = None, pace: Callable[[], object] | None = None) -> int:
        """Store the chunks of ``kv`` (computed over ``token_ids``) that are not stored yet.

        Returns the number of chunks written.  Every layer must hold all ``len(token_ids)``
        tokens (sliding-window layers cannot be split into prefix chunks).  With ``replicate``
        a chunk goes to every put tier that lacks it; without, a chunk that any tier holds is
        left as it is (no encoding: for callers that just loaded part of ``kv`` from the store).
        The token ids themselves are not stored: a chunk names its key instead.  ``pace``, when
        given, is called before each chunk and may block: a caller's way to let its loads have
        the link and the cores first.
        """
        token_ids = [int(t) for t in token_ids]
        if any(l.keys.shape[1] != len(token_ids) for l in kv.layers):
            raise InvalidInputError(f"every layer must hold {len(token_ids)} tokens, one per token id")
        self._check_cache(kv)
        targets = self.source.put_tiers()
        written = 0
        variants, seeds = self._state  # one snapshot: a codec switch meanwhile cannot pair a key with another codec
        for s, e, keys in self._variant_keys(token_ids, salt, seeds):
            if pace is not None:
                pace()
            wrote = False
            for codec, key in zip(variants, keys):
                if not replicate and self.holds(key):
                    continue
                positions = kv.positions[s:e] if kv.positions is not None else (
                    range(s, e) if codec.uses_positions else None)
                part = KVCache([(l.keys[:, s:e], l.values[:, s:e]) for l in kv.layers], model=self.model,
                               rope=kv.rope, positions=positions)
                wrote = self._write(key, codec, part, targets) > 0 or wrote
            written += wrote
        if written:
            self.source.hold_side_data(variants, targets)
        self.source.count("puts", written)
        return written

    def put_chunk(self, key: str, kv: KVCache) -> int:
        """Store ``kv``, one chunk of at most ``chunk_tokens`` tokens, under ``key`` (an :meth:`engine_key`) in every
        variant (each under its :meth:`chunk_keys`), in every put tier that lacks it.  Returns the bytes of the
        values stored (0: every put tier held them already, or none took them)."""
        if not 0 < kv.num_tokens <= self.chunk_tokens:
            raise InvalidInputError(f"a chunk holds 1 to {self.chunk_tokens} tokens, not {kv.num_tokens}")
        self._check_cache(kv)
        targets = self.source.put_tiers()
        variants, seeds = self._state  # one snapshot, as in put
        size = sum(self._write(k, codec, kv, targets) for codec, k in zip(variants, self._chunk_keys(key, seeds)))
        if size:
            self.source.hold_side_data(variants, targets)
            self.source.count("puts")
        return size

    def encode_chunk(self, key: str, kv: KVCache, codec: Codec | None = None) -> bytes:
        """The value stored under ``key`` for ``kv`` (one chunk) in ``codec`` (default the best variant): its
        container naming ``key``, sealed with the secret.  For engines that move values themselves (LMCache's
        serializer), which read them back through ``source.check``."""
        return seal(self.secret, key, encode(kv, codec or self.codec, chunk_tokens=kv.num_tokens,
                                             meta={STORE_KEY_META: key}))

    def _check_cache(self, kv: KVCache) -> None:
        if kv.model is not None and kv.model != self.model:
            raise InvalidInputError(f"the cache is of model {kv.model!r}, the store of {self.model!r}")
        if self.shape is not None and ChunkShape.of(kv) != self.shape:
            raise InvalidInputError(f"the cache is of shape {ChunkShape.of(kv)}, the store's engine {self.shape}")

    def _write(self, key: str, codec: Codec, part: KVCache, targets: Sequence[StorageTier]) -> int:
        """Encode ``part`` (one chunk) once and put it under ``key`` in each of ``targets`` that lacks it: the
        value's size, or 0 when none needed or took it."""
        missing = self.source.missing_from(key, targets)
        if not missing:
            return 0
        value = self.encode_chunk(key, part, codec)
        if not self.source.write(key, value, missing):
            return 0
        self.source.count("put_bytes", len(value))
        return len(value)

    def measure_decodes(self) -> dict[str, float]:
        """Time one decode of each variant this store has no decode rate of (none measured, none restored), on a
        chunk of ``chunk_tokens`` tokens of the engine's shape, into the rates loads plan with: a fresh engine's
        first load then plans on this machine's rates, not on an unmeasured variant decoding for free.  A variant
        with a rate (restored) is decoded once untimed, so that its first use is paid here, not in a first load.
        Does nothing with one variant (nothing to choose) or without a shape.  Returns the rates measured
        (tokens/s by codec id); a variant that cannot be timed so is left to the first load that decodes it."""
        variants, shape = self.variants, self.shape
        if len(variants) < 2 or shape is None:
            return {}
        dtype, heads, tokens = getattr(torch, shape.dtype), shape.heads, self.chunk_tokens
        generator = torch.Generator().manual_seed(0)
        # Normal noise, not real KV: kvtc decodes the components its calibration chose whatever their values
        # (SmolLM2, a 256-token chunk: 0.104 s on noise, 0.101 s on real KV), cachegen a symbol per element.
        kv = KVCache.from_tensors(
            [torch.randn(heads, tokens, shape.key_dim, generator=generator).to(dtype) for _ in range(shape.layers)],
            [torch.randn(heads, tokens, shape.value_dim, generator=generator).to(dtype) for _ in range(shape.layers)],
            model=self.model)
        measured: dict[str, float] = {}
        for codec in variants:
            rate = self.telemetry.decode_rate(codec)
            known = bool(rate.samples)  # (restored: decoded once, untimed)
            try:
                value = self.encode_chunk(MEASURE_KEY, kv, codec)
                # the second decode is timed: a process's first pays for first use (SmolLM2's kvtc: 0.16 s, then 0.10;
                # inside vLLM a fresh engine's first load, planning on a restored rate, took 0.5 s for its first)
                for _ in range(1 if known else 2):
                    t0 = time.perf_counter()
                    self.decode_value(MEASURE_KEY, value, tokens)
                    seconds = time.perf_counter() - t0
            except Exception as err:  # noqa: BLE001 - a codec that cannot code noise here is measured by a load
                log.warning("could not time a decode of %s: %s: %s", codec.codec_id, type(err).__name__, err)
                continue
            if not known:
                rate.observe(tokens, seconds)
                measured[codec.codec_id] = tokens / seconds if seconds > 0 else math.inf
        return measured

    def fetch_side_data(self) -> None:
        """Make what the variants need beyond their bytes (kvtc's calibration) available here, from the tiers if
        this machine lacks it."""
        self.source.fetch_side_data(self.variants)

    # reading -----------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int], *, salt: str | bytes | None = None) -> Lookup:
        """How many leading tokens of ``token_ids`` are stored in any variant and in every variant, and in which
        tier each chunk is."""
        chunks = self.variant_keys(token_ids, salt=salt)
        holder = self.source.holders([k for _, _, ks in chunks for k in ks])
        n, where, v, every = 0, [], len(self.variants), 0
        for c, (s, e, _) in enumerate(chunks):
            held = holder[c * v:(c + 1) * v]
            name = next((h for h in held[::-1] if h is not None), None)
            if name is None:
                break
            n, where = e, where + [name]
            every = e if every == s and None not in held else every
        return Lookup(n, where, every)

    def holds(self, key: str) -> bool:
        """Whether some tier holds ``key``."""
        return self.source.holders([key])[0] is not None

    def holds_chunk(self, key: str) -> bool:
        """Whether some tier holds an engine's chunk ``key`` (an :meth:`engine_key`) in some variant."""
        return any(h is not None for h in self.source.holders(self.chunk_keys(key)))

    def held_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` (:meth:`engine_key` values), from the first, some tier holds whole in some variant:
        an engine's prefix hit, in its own chunks.  A torn value is evicted here (:meth:`ChunkSource.held_prefix`).
        With several variants each is asked, best first, from the first chunk none of them reached yet."""
        per_chunk = [self.chunk_keys(k) for k in keys]
        held = 0
        while held < len(keys):
            reach = 0
            for v in reversed(range(len(self.variants))):
                reach = max(reach, self.source.held_prefix([ks[v] for ks in per_chunk[held:]]))
                if held + reach == len(keys):
                    break
            if not reach:
                break
            held += reach
        return held

    def fetch(self, token_ids: Sequence[int], *, salt: str | bytes | None = None) -> list[FetchedChunk]:
        """The checked, undecoded chunks of the stored prefix of ``token_ids``, up to the first chunk no tier holds
        intact (for tools that measure or inspect stored values; engines load through :meth:`prefix_load`)."""
        out: list[FetchedChunk] = []
        for key, s, e in self.keys_for([int(t) for t in token_ids], salt=salt):
            chunk = self.source.read(key, s, e)
            if chunk is None:
                break
            out.append(chunk)
        return out

    def prefix_load(self, token_ids: Sequence[int], sink: DenseSink | PagedSink, *, start: int = 0,
                    end: int | None = None, salt: str | bytes | None = None, device: torch.device | str | None = None,
                    recompute_tps: float | None = None, prefetch_bytes: int = DEFAULT_PREFETCH_BYTES) -> PrefixLoad:
        """A load (not started) of tokens ``start .. end-1`` of ``token_ids``'s stored prefix into ``sink``; the
        caller calls :meth:`PrefixLoad.start`, :meth:`PrefixLoad.wait_layer` and :meth:`PrefixLoad.finish`.
        ``recompute_tps`` (the engine's prefill speed) lets it stop where recomputing the rest is sooner
        (:mod:`kvcodec.store.plan`); ``device`` is where a dense decode runs; fetched chunks waiting for the decoder
        hold at most ``prefetch_bytes``."""
        planner = LoadPlanner(self.telemetry, self.variants, recompute_tps=recompute_tps,
                              first=not self.telemetry.loads_planned)
        self.telemetry.loads_planned += 1
        return PrefixLoad(self.source, self.variant_keys([int(t) for t in token_ids], salt=salt), sink,
                          planner=planner, start=start, end=end, device=device, prefetch_bytes=prefetch_bytes)

    def load_estimates(self, prompts: Sequence[Sequence[int]], *, salt: str | bytes | None = None
                       ) -> list[float | None]:
        """For each of ``prompts`` (token id lists), the seconds this store estimates loading its stored chunks
        takes, up to the first chunk no tier holds: each chunk in the variant whose read and decode together are the
        shortest by the load planner's estimates (:class:`~kvcodec.store.plan.LoadPlanner`), one after another;
        None where its first chunk is not held.  One size question per tier for all of them."""
        planner = LoadPlanner(self.telemetry, self.variants)
        chunks = [self.variant_keys([int(t) for t in p], salt=salt) for p in prompts]
        keys = [k for c in chunks for _, _, ks in c for k in ks]
        sizes = iter(self.source.value_sizes(keys, [b - a for c in chunks for a, b, ks in c for _ in ks]))
        out: list[float | None] = []
        for c in chunks:
            times: list[float] = []
            prefix = True  # every chunk so far held
            for a, b, ks in c:
                held = [Option(v, *size) for v, size in enumerate([next(sizes) for _ in ks]) if size is not None]
                prefix = prefix and bool(held)
                if prefix:
                    times.append(min(planner.fetch_s(o) + planner.decode_s(o, b - a) for o in held))
            out.append(sum(times) if times else None)
        return out

    def decode_chunk(self, chunk: FetchedChunk, *, device: torch.device | str | None = None) -> KVCache:
        """Decode a fetched chunk within the store's bound for its size."""
        sink = DenseSink(device=device)
        decode_chunk_into(chunk, sink, chunk.start, chunk.end, max_bytes=self.source.max_bytes(chunk.end - chunk.start),
                          device=device)
        return sink.cache(model=self.model)

    def decode_value(self, key: str, value: bytes, tokens: int | None = None, *,
                     device: torch.device | str | None = None) -> KVCache:
        """``value``, read by the engine itself (not from this store's tiers), checked as the chunk of ``tokens``
        tokens stored under ``key`` (the same check as every read: authentication, key, shape, size, checksums) and
        decoded.  Raises :class:`~kvcodec.errors.CorruptDataError` (or ``LimitExceededError``) for a value that is
        not; the engine, which holds it, decides what to evict."""
        return self.decode_chunk(self.source.check(key, value, tokens), device=device)

    def load_chunk(self, key: str, tokens: int | None = None, *,
                   device: torch.device | str | None = None) -> KVCache | None:
        """The chunk stored under ``key`` (an :meth:`engine_key`), read and checked by the store's source and
        decoded: for engines that ask for their chunks one at a time.  ``tokens`` None takes the count written for
        it.  None is a miss: no tier holds it intact, or it did not decode (a bad value is evicted).

        With several variants, the one that restores soonest by the store's estimates (its bytes over its tier's
        throughput, plus its decode; :class:`~kvcodec.store.plan.LoadPlanner`) is read, and the other when that one
        is missing or bad; the read and the decode feed the estimates every load shares, the choice is logged at
        DEBUG and counted in :attr:`stats` (``chunk_loads_<codec id>``)."""
        variants, seeds = self._state
        keys = self._chunk_keys(key, seeds)
        if len(keys) == 1:
            return self._load_variant(key, tokens, device)
        planner, n = LoadPlanner(self.telemetry, variants), tokens or self.chunk_tokens
        held = [Option(v, *found) for v, found in enumerate(self.source.value_sizes(keys, [n] * len(keys)))
                if found is not None]
        soonest = {o.variant: planner.fetch_s(o) + planner.decode_s(o, n) for o in held}
        order = sorted(held, key=lambda o: soonest[o.variant])
        for rank, option in enumerate(order):
            codec = variants[option.variant]
            kv = self._load_variant(keys[option.variant], tokens, device, codec)
            if kv is None:
                continue
            log.debug("chunk %s: %s from %s (%s)%s", key, codec.codec_id, option.tier,
                      ", ".join(f"{variants[o.variant].codec_id} {o.nbytes} B on {o.tier} in "
                                f"{soonest[o.variant] * 1e3:.3g} ms" for o in held),
                      f"; {rank} sooner one(s) missing or bad" if rank else "")
            self._count_chunk_load(codec)
            return kv
        if not held:
            self.source.count("misses")
        return None

    def _load_variant(self, key: str, tokens: int | None, device: torch.device | str | None,
                      codec: Codec | None = None) -> KVCache | None:
        """One variant's value under ``key``, read, checked and decoded (its decode timed into ``codec``'s rate);
        None when no tier holds it intact or it does not decode (a bad value is evicted)."""
        chunk = self.source.read(key, 0, tokens)
        if chunk is None:
            return None
        try:
            t0 = time.perf_counter()
            kv = self.decode_chunk(chunk, device=device)
        except Exception as err:
            self.source.discard(chunk, err)
            self.source.count("misses")
            return None
        if codec is not None:
            self.telemetry.decode_rate(codec).observe(chunk.end - chunk.start, time.perf_counter() - t0)
        return kv

    def _count_chunk_load(self, codec: Codec) -> None:
        with self._lock:
            name = f"chunk_loads_{codec.codec_id}"
            self._chunk_loads[name] = self._chunk_loads.get(name, 0) + 1

    def get(self, token_ids: Sequence[int], *, device: torch.device | str | None = None,
            salt: str | bytes | None = None) -> KVCache | None:
        """The decoded KV of the stored prefix of ``token_ids`` (None when nothing is stored).

        The prefix ends before the first chunk that is missing or does not decode (the caller recomputes from
        there); a bad chunk is evicted.  Chunks must agree in shape with the first (or with ``shape``).
        """
        token_ids = [int(t) for t in token_ids]
        sink = DenseSink(device=device)
        result = self.prefix_load(token_ids, sink, salt=salt, device=device).start().finish()
        if result.loaded_end == 0:
            return None
        return sink.cache(model=self.model, token_ids=token_ids[:result.loaded_end])

    # management --------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """This store's keys (its model and namespace) in every tier, sorted, each once."""
        return self.source.keys()

    def delete(self, key: str) -> bool:
        """Delete ``key`` from every tier; True when some tier held it."""
        return self.source.delete(key) > 0

    def evict(self, token_ids: Sequence[int], *, tiers: Sequence[str] | None = None,
              salt: str | bytes | None = None) -> int:
        """Delete the chunks of ``token_ids`` from ``tiers`` (default all); returns deletions."""
        targets = None if tiers is None else [self.tier(n) for n in tiers]
        return sum(self.source.delete(key, targets) for key, _, _ in self.keys_for(token_ids, salt=salt))

    def promote(self, token_ids: Sequence[int], *, to: str | None = None, salt: str | bytes | None = None) -> int:
        """Copy the stored chunks of ``token_ids`` into tier ``to`` (default the fastest); returns copies."""
        target = self.tiers[0] if to is None else self.tier(to)
        n = 0
        for key, _, _ in self.keys_for(token_ids, salt=salt):
            copied = self.source.copy(key, target)
            if copied is None:
                break
            n += copied
        self.source.count("promoted", n)
        return n

    def close(self) -> None:
        if self.telemetry_file is not None:
            self.telemetry_file.close()
        self.source.close()


def _variants(codec: str | Codec | Sequence[str | Codec], options: dict[str, Any] | None, model: str,
              digest: str) -> list[Codec]:
    """The store's codecs: one, or a list of variants (smallest first), each resolved for ``model`` of weights
    ``digest`` (e.g. kvtc's calibration)."""
    from kvcodec.codecs.registry import codec_from_spec, parse_spec

    if isinstance(codec, Codec):
        codecs = [codec]
    elif isinstance(codec, str):
        codec_id, inline = parse_spec(codec)  # "cachegen:level=2", as a variant list's specs are
        if inline and options:
            raise InvalidInputError(f"codec {codec!r} has its options in its spec; give them there or in "
                                    f"codec_options {dict(options)!r}, not both")
        codecs = [get_codec(codec_id, **(inline or options or {}))]
    else:
        codecs = [c if isinstance(c, Codec) else codec_from_spec(str(c)) for c in codec]
        if not codecs or options:
            raise InvalidInputError("a list of codec variants needs at least one, each with its options in its spec "
                                    "(\"kvtc:level=0\"), and no codec_options")
    out = [c.for_cache(SimpleNamespace(model=model, model_digest=digest)) for c in codecs]
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
