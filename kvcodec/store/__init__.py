"""A tiered KV store keyed by token-prefix hashes (GPU, CPU memory, local disk, Redis, Mooncake Store).

>>> from kvcodec.store import KVStore, MemoryTier, DiskTier, RedisTier
>>> store = KVStore([MemoryTier(2 << 30), DiskTier("/var/cache/kv"), RedisTier("127.0.0.1", 6379)],
...                 model="SmolLM2-135M-Instruct", codec="cachegen")
>>> store.put(token_ids, kv)              # chunks of 256 tokens, each a single-chunk container
>>> store.lookup(token_ids).num_tokens  # stored prefix length (.where: the tier of each chunk)
>>> prefix_kv = store.get(token_ids)      # decoded KVCache of the stored prefix (or None)

Engine hooks load through :meth:`KVStore.prefix_load`: a :class:`PrefixLoad` (:mod:`kvcodec.store.load`) that
streams chunks into their memory (a :class:`DenseSink` or :class:`PagedSink`).  The parts: ``tiers`` (one module
per tier, and the URL grammar), ``source`` (read, check, evict), ``telemetry`` (link and decode rates), ``plan``
and ``load``; ``store`` is the facade over them.
"""

from kvcodec.store.auth import UnauthenticatedError
from kvcodec.store.identity import CacheIdentity, model_digest, model_identity, request_salt
from kvcodec.store.keys import HASHES, SegmentDomain, chunk_bounds, chunk_hashes, format_key, namespace
from kvcodec.layouts.sinks import DenseSink, PagedSink
from kvcodec.store.chunks import ChunkShape, FetchedChunk
from kvcodec.store.load import ChunkOutcome, LoadResult, PrefixLoad
from kvcodec.store.source import ChunkSource, PlacementPolicy
from kvcodec.store.store import DEFAULT_STORE_CHUNK_TOKENS, KVStore, Lookup, concat
from kvcodec.store.telemetry import RateEstimator, Telemetry
from kvcodec.store.tiers import DiskTier, GPUTier, MemoryTier, MooncakeTier, RedisTier, StorageTier, tier_from_url

__all__ = [
    "KVStore", "Lookup", "PlacementPolicy", "FetchedChunk", "ChunkShape", "concat", "DEFAULT_STORE_CHUNK_TOKENS",
    "PrefixLoad", "DenseSink", "PagedSink", "LoadResult", "ChunkOutcome", "ChunkSource", "Telemetry", "RateEstimator",
    "CacheIdentity", "model_digest", "model_identity", "request_salt", "UnauthenticatedError",
    "StorageTier", "MemoryTier", "GPUTier", "DiskTier", "RedisTier", "MooncakeTier", "tier_from_url",
    "HASHES", "namespace", "chunk_bounds", "chunk_hashes", "format_key", "SegmentDomain",
]
