"""An engine's chunks in several variants (issue 33, item 4): KVStore.put_chunk writes each variant of a chunk, and
load_chunk reads the one that restores soonest by the store's estimates, the other when that one is missing or bad.
Real SmolLM2 KV (128-token chunks: raw 2.9 MB, cachegen about a fifth of it), estimates pinned."""

from __future__ import annotations

import logging

import pytest
import torch
from stand_ins import Pinned

from kvcodec.cache import KVCache
from kvcodec.store import KVStore, MemoryTier

CHUNK = 128
CONTEXT = b"test-engine/1\0"
SLOW_BPS, FAST_BPS = 1e6, 1e10  # a link where raw takes 2.9 s and cachegen 0.6 s; one where raw takes 0.3 ms
CACHEGEN_TPS = CHUNK / 0.05  # cachegen decodes a chunk in 50 ms, raw in no time


def _chunks(real_kv, n: int = 3) -> list[KVCache]:
    return [KVCache([(l.keys[:, i * CHUNK:(i + 1) * CHUNK], l.values[:, i * CHUNK:(i + 1) * CHUNK])
                     for l in real_kv.layers], model=real_kv.model) for i in range(n)]


def pin(store: KVStore, bps: float) -> None:
    """The store believes its tiers give ``bps`` and cachegen decodes at CACHEGEN_TPS, whatever it measures."""
    for name in store.telemetry.links:
        store.telemetry.link(name).throughput = Pinned(bps)
    store.telemetry.decode_rate = lambda codec: Pinned(CACHEGEN_TPS if codec.codec_id == "cachegen" else 1e12)


def _stored(real_kv, codec=("cachegen", "raw"), n: int = 3) -> tuple[KVStore, list[str], list[KVCache]]:
    store = KVStore([MemoryTier(None)], model=real_kv.model, codec=list(codec), chunk_tokens=CHUNK)
    keys, chunks = [store.engine_key(f"page-{i}", CONTEXT) for i in range(n)], _chunks(real_kv, n)
    for key, kv in zip(keys, chunks):
        assert store.put_chunk(key, kv) > 0
    return store, keys, chunks


def _exact(a: KVCache, b: KVCache) -> bool:
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))


@pytest.mark.parametrize("bps, chosen", [(SLOW_BPS, "cachegen"), (FAST_BPS, "raw")])
def test_each_chunk_loads_in_the_variant_that_restores_soonest(real_kv, caplog, bps, chosen):
    store, keys, chunks = _stored(real_kv)
    tier = store.tiers[0]
    small, large = (len(tier.get(k)) for k in store.chunk_keys(keys[0]))
    assert small < large / 3  # both variants of every chunk are stored, under keys of their own
    pin(store, bps)
    caplog.set_level(logging.DEBUG, logger="kvcodec.store.store")
    loaded = [store.load_chunk(k, CHUNK) for k in keys]
    assert store.stats[f"chunk_loads_{chosen}"] == 3 and len([s for s in store.stats if "chunk_loads" in s]) == 1
    assert all(_exact(kv, want) for kv, want in zip(loaded, chunks)) == (chosen == "raw")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcodec.store.store"]
    assert len(lines) == 3 and all(line.startswith(f"chunk {k}: {chosen} from cpu (cachegen ")
                                   for line, k in zip(lines, keys)), lines


@pytest.mark.parametrize("fault", ["missing", "damaged"])
def test_a_missing_or_bad_chosen_variant_falls_back_to_the_other(real_kv, fault):
    store, keys, chunks = _stored(real_kv)
    pin(store, FAST_BPS)  # raw is chosen
    tier, raw_key = store.tiers[0], store.chunk_keys(keys[1])[1]
    if fault == "missing":
        tier.delete(raw_key)
    else:
        value = tier.get(raw_key)
        tier.put(raw_key, value[:5000] + bytes([value[5000] ^ 1]) + value[5001:])
    kv = store.load_chunk(keys[1], CHUNK)
    assert kv is not None and not _exact(kv, chunks[1])  # cachegen's decode of it
    assert store.stats["chunk_loads_cachegen"] == 1 and not tier.contains(raw_key)
    assert store.stats["corrupt"] == (fault == "damaged")
    tier.delete(store.chunk_keys(keys[1])[0])
    assert store.load_chunk(keys[1], CHUNK) is None  # neither variant: a miss


def test_loads_feed_the_estimates_every_hook_shares(real_kv):
    store, keys, _ = _stored(real_kv)
    cachegen = store.variants[0]
    assert not store.telemetry.decode_rate(cachegen).samples  # never decoded: the planner takes it as free
    store.load_chunk(keys[0], CHUNK)
    assert store.stats["chunk_loads_cachegen"] == 1  # so it is tried first, and measured
    assert store.telemetry.decode_rate(cachegen).samples and store.telemetry.link("cpu").throughput.samples


def test_a_chunk_held_in_any_variant_is_held(real_kv):
    store, keys, _ = _stored(real_kv)
    tier = store.tiers[0]
    tier.delete(store.chunk_keys(keys[0])[1])
    tier.delete(store.chunk_keys(keys[1])[0])
    torn = store.chunk_keys(keys[2])[1]
    tier.put(torn, tier.get(torn)[:-10])
    assert store.held_prefix(keys) == 3 and not tier.contains(torn) and store.stats["corrupt"] == 1
    assert store.holds_chunk(keys[0]) and store.holds_chunk(keys[1])
    tier.delete(store.chunk_keys(keys[1])[1])
    assert store.held_prefix(keys) == 1 and not store.holds_chunk(keys[1])


def test_one_variant_keys_and_stores_as_before(real_kv):
    """A store of one codec keeps a chunk under the engine's key itself, in one value, read back without a choice;
    a store that adds a smaller variant finds those values as its large variant's."""
    store, keys, chunks = _stored(real_kv, codec=["raw"], n=1)
    tier = store.tiers[0]
    assert store.chunk_keys(keys[0]) == keys and tier.keys() == keys
    assert tier.get(keys[0]) == store.encode_chunk(keys[0], chunks[0])
    assert _exact(store.load_chunk(keys[0], CHUNK), chunks[0])
    assert not any("chunk_loads" in s for s in store.stats) and store.stats["hits"] == 1
    both = KVStore(store.tiers, model=real_kv.model, codec=["cachegen", "raw"], chunk_tokens=CHUNK)
    assert both.engine_key("page-0", CONTEXT) == keys[0] and both.held_prefix(keys) == 1
    assert _exact(both.load_chunk(keys[0], CHUNK), chunks[0]) and both.stats["chunk_loads_raw"] == 1
