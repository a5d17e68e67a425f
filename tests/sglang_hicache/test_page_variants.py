"""Pages in two variants through SGLang's own save and prefetch (issue 33, item 4): with ``"codec": ["cachegen",
"raw"]`` every page is stored in both, and each page loads in the one that restores soonest by the store's
estimates (pinned here), the other when that one is missing."""

from __future__ import annotations

import pytest
from sglang.srt.mem_cache.utils import get_storage_hash_str
from stand_ins import Pinned
from test_hicache import LOADED, SAVED, attach, prefetch, same_bits, save

from kvcodec.cache import KVCache
from kvcodec.tools.harness.sglang_pools import (
    PAGE,
    TOKENS,
    make_host_pool,
    read_tokens,
    write_tokens,
)

PAGES = TOKENS // PAGE


@pytest.mark.parametrize("bps, chosen", [(1e10, "raw"), (1e5, "cachegen")])
def test_each_page_loads_in_the_variant_that_restores_soonest(real_pages, bps, chosen):
    kv, ids = real_pages
    pool = make_host_pool("layer_first")
    write_tokens(pool, SAVED, kv)
    backend = attach(pool, codec=["cachegen", "raw"], interface_v1=1, telemetry="off")
    assert save(backend, pool, ids, zero_copy=True)
    store, hashes = backend.store, get_storage_hash_str(ids, None, page_size=PAGE)
    store.telemetry.link(store.tiers[0].name).throughput = Pinned(bps)
    store.telemetry.decode_rate = lambda codec: Pinned(PAGE / 0.05 if codec.codec_id == "cachegen" else 1e12)
    store.tiers[0].delete(store.chunk_keys(backend.key(hashes[3]))[1 if chosen == "raw" else 0])
    assert prefetch(backend, pool, ids, zero_copy=True) == (TOKENS, PAGES)  # a page in either variant is a hit
    other = "cachegen" if chosen == "raw" else "raw"
    assert store.stats[f"chunk_loads_{chosen}"] == PAGES - 1 and store.stats[f"chunk_loads_{other}"] == 1
    raw_page = slice(0, PAGE) if chosen == "raw" else slice(3 * PAGE, 4 * PAGE)  # a page that loaded raw
    want = KVCache([(l.keys[:, raw_page], l.values[:, raw_page]) for l in kv.layers])
    assert same_bits(read_tokens(pool, LOADED[raw_page]), want)  # bit exact; the whole prompt is not
    assert not same_bits(read_tokens(pool, LOADED), kv)
    backend.close()
