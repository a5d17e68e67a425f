"""Damaged pages and SGLang's hit query (issue 35, item 9): ``batch_exists`` counted a damaged page as stored until
a read evicted it, so SGLang reserved host memory for it and its prefetch failed on it.  A page that does not end
whole (truncated, extended, emptied, overwritten) is now evicted by the hit query itself, once, and answers absent;
one damaged within is still found, and evicted once, by its first read (see ``batch_exists`` for the cost)."""

from __future__ import annotations

import pytest
from sglang.srt.mem_cache.utils import get_storage_hash_str
from test_hicache import LOADED, SAVED, attach, prefetch, same_bits, save

from kvcodec.cache import KVCache
from kvcodec.tools.harness.sglang_pools import PAGE, TOKENS, make_host_pool, read_tokens, write_tokens

TORN = {
    "truncated": lambda v: v[: len(v) // 2],
    "short by a byte": lambda v: v[:-1],
    "extended": lambda v: v + b"\0",
    "empty": lambda v: b"",
    "garbage": lambda v: bytes(range(256)) * 64,
}


def _saved(real_pages, **extra):
    kv, ids = real_pages
    pool = make_host_pool("layer_first")
    write_tokens(pool, SAVED, kv)
    backend = attach(pool, codec="raw", interface_v1=1, **extra)
    assert save(backend, pool, ids, zero_copy=True)
    return backend, pool, get_storage_hash_str(ids, None, page_size=PAGE)


def _first_pages(kv: KVCache, pages: int) -> KVCache:
    return KVCache([(l.keys[:, :pages * PAGE], l.values[:, :pages * PAGE]) for l in kv.layers])


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("kind", sorted(TORN))
def test_exists_counted_a_torn_page_until_a_read_evicted_it(real_pages, tmp_path, tier, kind):
    kv, ids = real_pages
    backend, pool, hashes = _saved(real_pages, tiers=["cpu" if tier == "cpu" else f"disk:{tmp_path}"])
    store, bad = backend.store, backend.key(hashes[2])
    store.tiers[0].put(bad, TORN[kind](store.tiers[0].get(bad)))
    # SGLang's prefetch: its hit query stops before the torn page, so only the two pages before it are read
    assert prefetch(backend, pool, ids, zero_copy=True) == (2 * PAGE, 2)
    assert not store.tiers[0].contains(bad) and store.stats["corrupt"] == 1  # evicted by the query
    assert same_bits(read_tokens(pool, LOADED[: 2 * PAGE]), _first_pages(kv, 2))
    assert backend.batch_exists(hashes) == 2 and not backend.exists(hashes[2]) and store.stats["corrupt"] == 1
    assert save(backend, pool, ids, zero_copy=True) and backend.batch_exists(hashes) == 8  # written again


def test_a_torn_page_in_the_fast_tier_leaves_the_slower_copy_counted(real_pages, tmp_path):
    kv, ids = real_pages
    backend, pool, hashes = _saved(real_pages, tiers=["cpu", f"disk:{tmp_path}"])
    memory, disk = backend.store.tiers
    bad = backend.key(hashes[5])
    memory.put(bad, memory.get(bad)[:100])
    assert backend.batch_exists(hashes) == 8
    assert not memory.contains(bad) and disk.contains(bad) and backend.store.stats["corrupt"] == 1
    assert prefetch(backend, pool, ids, zero_copy=True) == (TOKENS, TOKENS // PAGE)
    assert same_bits(read_tokens(pool, LOADED), kv)


def test_a_torn_sealed_page_is_not_counted(real_pages, monkeypatch):
    """With the deployment's secret each value ends in its tag, after the container's footer."""
    monkeypatch.setenv("KVCODEC_STORE_SECRET", "s" * 32)
    backend, pool, hashes = _saved(real_pages)
    assert backend.batch_exists(hashes) == 8
    tier, bad = backend.store.tiers[0], backend.key(hashes[0])
    tier.put(bad, tier.get(bad)[:-16])  # half its tag gone
    assert backend.batch_exists(hashes) == 0 and not tier.contains(bad) and backend.store.stats["corrupt"] == 1


def test_a_page_damaged_within_is_evicted_by_its_first_read_then_absent(real_pages):
    """A flipped bit inside a page leaves its length and footer whole: the hit query counts it, the read's full
    check refuses and evicts it, and from then on it is absent."""
    backend, pool, hashes = _saved(real_pages)
    tier, bad = backend.store.tiers[0], backend.key(hashes[3])
    value = tier.get(bad)
    tier.put(bad, value[:5000] + bytes([value[5000] ^ 1]) + value[5001:])
    assert backend.batch_exists(hashes) == 8
    assert backend.batch_get_v1(hashes, LOADED) == [True] * 3 + [False] * 5
    assert backend.batch_exists(hashes) == 3 and backend.store.stats["corrupt"] == 1
    assert backend.batch_exists(hashes) == 3 and backend.store.stats["corrupt"] == 1
