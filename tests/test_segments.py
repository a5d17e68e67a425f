"""Segments in the store (issue 34, item 1): a document's KV keyed by its own tokens after an anchor, through the
store's own put and load path (memory and disk tiers, variant lists, the same checks), found whatever precedes it
in a prompt, and apart from prefix chunks and request salts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec.blend import RecomputeSchedule, SegmentStore, default_anchor
from kvcodec.cache import KVCache
from kvcodec.errors import InvalidInputError
from kvcodec.store import DiskTier, KVStore, MemoryTier
from kvcodec.store.keys import SegmentDomain

ANCHOR = (1,)


def _kv(tokens: int, seed: int = 0, layers: int = 2) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache([(torch.randn(2, tokens, 16, generator=g), torch.randn(2, tokens, 16, generator=g))
                    for _ in range(layers)], rope="post")


def _store(tiers, codec="raw", **kw) -> KVStore:
    return KVStore(tiers, model="demo-model", codec=codec, chunk_tokens=64, **kw)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_segment_round_trips_through_a_tier(tier, tmp_path):
    store = _store([MemoryTier(64 << 20) if tier == "memory" else DiskTier(tmp_path / "kv")])
    segments = SegmentStore(store, ANCHOR)
    ids, kv = list(range(100, 250)), _kv(150)
    assert segments.put(ids, kv) == 3  # 64 + 64 + 22 tokens
    assert segments.stored_tokens(ids) == 150
    got = segments.load(ids)
    assert got.loaded == got.tokens == 150 and got.load.complete
    assert got.kv.positions == list(range(1, 151))  # computed after the one-token anchor
    assert got.kv.equal(KVCache(kv.layers))
    assert segments.put(ids, kv) == 0  # stored already


def test_variants_of_a_segment_load_either(tmp_path):
    store = _store([MemoryTier(64 << 20)], codec=["kivi:bits=4", "raw"])
    segments = SegmentStore(store, ANCHOR)
    ids, kv = list(range(70)), _kv(70)
    segments.put(ids, kv)
    for key in store.keys():  # drop one variant's chunks: the other still serves the segment
        if any(key == keys[1] for _, _, keys in store.variant_keys(ids, salt=segments.domain)):
            store.delete(key)
    got = segments.load(ids)
    assert got.loaded == 70 and got.load.chunks[0].variant == 0
    assert torch.allclose(got.kv.layers[0].values, kv.layers[0].values, atol=0.5)


def test_segment_keys_depend_on_its_tokens_and_anchor_only():
    store = _store([MemoryTier(64 << 20)])
    segments = SegmentStore(store, ANCHOR)
    doc, kv = list(range(500, 600)), _kv(100)
    segments.put(doc, kv)
    # the same document after any other prompt text is the same segment
    assert segments.stored_tokens(doc) == 100
    # but never a prefix chunk: the same tokens as a prompt of their own, or inside another prompt, miss
    assert store.lookup(doc).num_tokens == 0
    store.put([7] * 30 + doc, _kv(130, 1))
    assert segments.stored_tokens([7] * 30 + doc) == 0
    # a segment computed after another anchor is another segment (its KV differs)
    assert SegmentStore(store, (2,)).stored_tokens(doc) == 0
    # and no request salt reaches the segments' chain, whatever its text
    keys = {k for k, _, _ in store.keys_for(doc, salt=segments.domain)}
    for salt in ("segment:", "segment:\x01", b"segment:" + bytes(8), str(SegmentDomain(ANCHOR))):
        assert not keys & {k for k, _, _ in store.keys_for(doc, salt=salt)}


def test_a_missing_chunk_ends_the_segment_and_a_bad_one_is_evicted():
    tier = MemoryTier(64 << 20)
    store = _store([tier])
    segments = SegmentStore(store, ANCHOR)
    ids, kv = list(range(150)), _kv(150)
    segments.put(ids, kv)
    keys = [k for k, _, _ in store.keys_for(ids, salt=segments.domain)]
    store.delete(keys[1])
    got = segments.load(ids)
    assert (got.tokens, got.loaded) == (150, 64) and got.kv.num_tokens == 64
    segments.put(ids, kv)
    value = bytearray(tier.get(keys[0]))
    value[-100] ^= 0xFF
    tier.put(keys[0], bytes(value))
    got = segments.load(ids)
    assert got.loaded == 0 and got.kv is None and not tier.contains(keys[0])


def test_a_store_with_a_secret_authenticates_segments():
    secret = b"0123456789abcdef0123"
    tier = MemoryTier(64 << 20)
    SegmentStore(_store([tier], secret=secret), ANCHOR).put(list(range(40)), _kv(40))
    assert SegmentStore(_store([tier], secret=secret), ANCHOR).load(list(range(40))).loaded == 40
    other = SegmentStore(_store([tier], secret=b"another secret, 20 b"), ANCHOR)
    assert other.load(list(range(40))).loaded == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.integers(1, 200), anchor=st.lists(st.integers(0, 49151), max_size=3), seed=st.integers(0, 99))
def test_any_segment_round_trips_bit_exactly(tokens, anchor, seed):
    segments = SegmentStore(_store([MemoryTier(64 << 20)]), anchor)
    ids = [(seed * 7919 + i) % 49152 for i in range(tokens)]
    kv = _kv(tokens, seed, layers=1)
    segments.put(ids, kv)
    got = segments.load(ids)
    assert got.kv.equal(KVCache(kv.layers)) and got.kv.positions == list(range(len(anchor), len(anchor) + tokens))


def test_bad_input_is_refused():
    store = _store([MemoryTier(64 << 20)])
    segments = SegmentStore(store, ANCHOR)
    with pytest.raises(InvalidInputError, match="at least one token"):
        segments.put([], _kv(1))
    with pytest.raises(InvalidInputError, match="rope='post'"):
        segments.put([1, 2], KVCache(_kv(2).layers, rope="pre"))
    with pytest.raises(InvalidInputError, match="positions 1..2"):
        segments.put([1, 2], KVCache(_kv(2).layers, rope="post", positions=[0, 1]))
    with pytest.raises(InvalidInputError, match="has 2 tokens"):
        segments.put([1, 2], _kv(3))
    with pytest.raises(InvalidInputError, match="save_partial"):
        SegmentStore(_store([MemoryTier(64 << 20)], save_partial=False))
    for bad in (-0.1, 1.5, "0.1"):
        with pytest.raises(InvalidInputError, match="share"):
            RecomputeSchedule(bad)


def test_the_default_anchor_is_the_models_bos_token():
    class Config:
        bos_token_id = 1
    assert default_anchor(Config()) == (1,)
    assert default_anchor(object()) == ()


def test_the_load_estimate_is_bytes_over_the_link_plus_tokens_at_the_decode_rate():
    """The loading controller's input (issue 34, item 3): the store's own estimates, not a timing."""
    from types import SimpleNamespace

    from kvcodec.blend import estimated_load_s
    from kvcodec.store.telemetry import Telemetry

    store = _store([MemoryTier(64 << 20)])
    segments = SegmentStore(store, ANCHOR)
    ids = list(range(100))
    segments.put(ids, _kv(100))
    chunks = segments.load(ids).load.chunks
    assert [c.end - c.start for c in chunks] == [64, 36]
    telemetry = Telemetry([chunks[0].tier])
    for _ in range(3):
        telemetry.link(chunks[0].tier).throughput.observe(2e6, 1.0)  # 2 MB/s
        telemetry.decode_rate(store.variants[0]).observe(1000, 1.0)  # 1,000 tokens/s
    estimate = estimated_load_s(SimpleNamespace(telemetry=telemetry, variants=store.variants), chunks)
    assert estimate == pytest.approx(sum(c.nbytes for c in chunks) / 2e6 + 100 / 1000)
    # a chunk that did not load costs nothing
    chunks[1].status = "missing"
    assert estimated_load_s(SimpleNamespace(telemetry=telemetry, variants=store.variants), chunks) == \
        pytest.approx(chunks[0].nbytes / 2e6 + 64 / 1000)


def test_the_loading_controller_recomputes_what_hides_under_loading():
    from kvcodec.blend import SHARE_FLOOR, controlled_share

    # 30 layers, 1,000 reusable tokens, 10 us per token-layer: one layer recomputes 1% of them in 0.1 ms
    slow = controlled_share(0.006 * 30, 30, 1000, 10e-6)  # 6 ms a layer to load: 60% recomputes in 6 ms
    assert slow.share == pytest.approx(0.6) and slow.reason.startswith("loading-bound")
    assert controlled_share(10.0, 30, 1000, 10e-6).share == 1.0  # slower than a full prefill: recompute all
    fast = controlled_share(0.001, 30, 1000, 10e-6)  # in memory: the quality floor
    assert fast.share == SHARE_FLOOR and fast.reason.startswith("quality floor")
    assert controlled_share(0.001, 30, 1000, 10e-6, floor=0.0).share == pytest.approx(0.001 / 30 / 1000 / 10e-6)
    # a slower model hides less under the same load
    assert controlled_share(0.006 * 30, 30, 1000, 15e-6, floor=0.1).share == pytest.approx(0.4)
    assert controlled_share(0.0, 30, 0, 10e-6).share == SHARE_FLOOR
    with pytest.raises(InvalidInputError, match="floor"):
        controlled_share(1.0, 30, 1000, 1e-5, floor=1.5)
    with pytest.raises(InvalidInputError, match="non-negative"):
        controlled_share(-1.0, 30, 1000, 1e-5)
    assert RecomputeSchedule(None).share is None  # None: the controller's


def test_segment_loads_come_in_prompt_order_into_one_context():
    """The background loads the fusion recomputes behind (issue 34, item 3): each segment is in its place, with
    its keys moved there, by the time wait returns; a segment not stored is forced; the estimate of what is left
    falls to 0."""
    from kvcodec.blend import SegmentLoads
    from kvcodec.store.chunks import ChunkShape

    shape = ChunkShape(2, 2, 16, 16, "float32")
    store = _store([MemoryTier(64 << 20)], shape=shape)
    segments = SegmentStore(store, ANCHOR)
    docs = [list(range(100, 140)), list(range(200, 250)), list(range(300, 330))]
    kvs = [_kv(len(d), seed=i) for i, d in enumerate(docs)]
    for d, kv in zip(docs[:2], kvs[:2]):
        segments.put(d, kv)
    order = [docs[1], docs[2], docs[0]]
    loads = SegmentLoads(segments, order, shape, [None] * kvs[0].num_layers).start()
    hits = [loads.wait(j) for j in range(3)]
    assert [(h.start, h.tokens, h.loaded) for h in hits] == [(len(ANCHOR), 50, 50), (len(ANCHOR) + 50, 30, 0),
                                                           (len(ANCHOR) + 80, 40, 40)]
    context = loads.context()
    assert context.token_ids == list(ANCHOR) + docs[1] + docs[2] + docs[0]
    assert context.forced.tolist() == [True] * len(ANCHOR) + [False] * 50 + [True] * 30 + [False] * 40
    _, v = context.layers[0]
    assert torch.equal(v[:, len(ANCHOR) + 80:], kvs[0].layers[0].values)  # values do not move
    assert loads.estimate_left_s() == 0.0
    # a failure of the loads reaches whoever waits on them
    def fail(*args, **kwargs):
        raise OSError("the tier went away")

    segments.load = fail
    with pytest.raises(OSError, match="went away"):
        SegmentLoads(segments, order, shape, [None] * kvs[0].num_layers).start().wait(0)


def test_the_share_is_spread_over_the_segments_by_position():
    from kvcodec.blend import segment_shares

    spans = [(1, 101), (101, 201), (201, 301)]  # mean positions 51, 151, 251
    shares = segment_shares(0.3, spans)
    assert shares == pytest.approx([0.3 * 51 / 151, 0.3, 0.3 * 251 / 151])
    assert sum(x * 100 for x in shares) == pytest.approx(0.3 * 300)  # together: the share asked for
    # none above 1: what the last cannot take goes to the others, in the same proportion
    high = segment_shares(0.7, spans)
    assert high[2] == 1.0 and high[0] / high[1] == pytest.approx(51 / 151)
    assert sum(x * 100 for x in high) == pytest.approx(0.7 * 300)
    assert segment_shares(1.0, spans) == [1.0, 1.0, 1.0] and segment_shares(0.0, spans) == [0.0, 0.0, 0.0]
    with pytest.raises(InvalidInputError):
        segment_shares(1.5, spans)
