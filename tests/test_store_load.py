"""The store's one load path (kvcodec.store.load): streaming, paged writes, per-chunk outcomes, and the planner that
chooses a stored variant per chunk or stops for the engine to recompute (kvcodec.store.plan)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from stand_ins import Pinned

from kvcodec.cache import KVCache
from kvcodec.codecs.raw import Raw
from kvcodec.layouts.paged import empty_shape, read_paged, slot_mapping
from kvcodec.store import DenseSink, KVStore, MemoryTier, PagedSink
from kvcodec.store.plan import LoadPlanner, finish_s
from kvcodec.store.telemetry import Contention
from kvcodec.store.telemetry import Link as Measured

CHUNK, LAYERS, HEADS, DIM, BS = 32, 3, 2, 16, 16


def _kv(n: int, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache([(torch.randn(HEADS, n, DIM, generator=g).half(), torch.randn(HEADS, n, DIM, generator=g).half())
                    for _ in range(LAYERS)], model="m")


class SlowTier(MemoryTier):
    """Memory, but each read takes ``delay`` seconds (a link), and the reads are logged."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(None)
        self.delay, self.log = delay, []

    def get(self, key, max_bytes=None):
        self.log.append(("fetch", key, time.perf_counter()))
        time.sleep(self.delay)
        return super().get(key, max_bytes)


def _store(tier, codec="raw") -> tuple[KVStore, list[int], KVCache]:
    store = KVStore([tier], model="m", codec=codec, chunk_tokens=CHUNK)
    ids, kv = list(range(1000, 1000 + 4 * CHUNK)), _kv(4 * CHUNK)
    store.put(ids, kv)
    return store, ids, kv


def test_fetch_of_the_next_chunk_overlaps_the_decode_of_this_one(monkeypatch):
    tier = SlowTier(0.15)
    store, ids, kv = _store(tier)
    decodes = []
    real = Raw.decode_layer

    def slow(self, data, ctx):
        decodes.append((ctx.layer, time.perf_counter()))
        time.sleep(0.05)
        return real(self, data, ctx)

    monkeypatch.setattr(Raw, "decode_layer", slow)
    sink = DenseSink()
    t0 = time.perf_counter()
    result = store.prefix_load(ids, sink).start().finish()
    took = time.perf_counter() - t0
    assert result.complete and [c.status for c in result.chunks] == ["loaded"] * 4
    # serial: 4 x 0.15 s of fetch + 4 x 3 x 0.05 s of decode = 1.2 s; streamed: about 0.15 + 4 x 0.15 = 0.75 s
    fetch_times = [t for what, _, t in tier.log if what == "fetch"]
    assert fetch_times[1] < decodes[LAYERS - 1][1]  # chunk 1 was being fetched while chunk 0 decoded
    assert took < 1.1, took
    for mine, theirs in zip(sink.cache().layers, kv.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("prefetch_bytes, fetched", [(64 << 20, 4), (1, 3)])
def test_fetched_chunks_wait_for_the_decoder_within_a_byte_budget(monkeypatch, prefetch_bytes, fetched):
    """With room, the fetch thread reads every chunk while the decoder is still on the first; with a budget smaller
    than a chunk, one chunk waits at a time: chunk 0 decoding, chunk 1 waiting, chunk 2 in the fetch thread's hand."""
    store, ids, _ = _store(SlowTier(0.0))
    gate = threading.Event()
    real = Raw.decode_layer

    def held(self, data, ctx):
        gate.wait(5)
        return real(self, data, ctx)

    monkeypatch.setattr(Raw, "decode_layer", held)
    load = store.prefix_load(ids, DenseSink(), prefetch_bytes=prefetch_bytes).start()
    time.sleep(0.3)  # the decoder is stuck in chunk 0
    reads = len(store.tiers[0].log)
    gate.set()
    assert load.finish().complete
    assert reads == fetched


def test_a_layer_is_ready_before_the_last_layer_is_decoded(monkeypatch):
    store, ids, _ = _store(MemoryTier(None))
    gate = threading.Event()
    real = Raw.decode_layer
    last = store.fetch(ids)[-1].sections[LAYERS - 1]  # the last chunk's last layer

    def held(self, data, ctx):
        if data == last:
            gate.wait(5)
        return real(self, data, ctx)

    monkeypatch.setattr(Raw, "decode_layer", held)
    load = store.prefix_load(ids, DenseSink()).start()
    assert load.wait_layer(0, timeout=5)  # while the last layer of the last chunk is still held back
    with pytest.raises(TimeoutError):
        load.wait_layer(LAYERS - 1, timeout=0.2)
    gate.set()
    assert load.wait_layer(LAYERS - 1, timeout=5) and load.finish().complete


def _paged_sink(n_tokens: int, fill: float = 7.0) -> tuple[PagedSink, list[torch.Tensor], torch.Tensor]:
    blocks = torch.randperm(16, generator=torch.Generator().manual_seed(3))[: -(-n_tokens // BS)]
    layers = [torch.full(empty_shape("cpu", 16, BS, HEADS, DIM), fill, dtype=torch.float16) for _ in range(LAYERS)]
    return PagedSink(layers, blocks.tolist(), BS, "cpu"), layers, blocks


def test_a_paged_load_writes_only_the_tokens_asked_for():
    """Tokens before ``start`` are in blocks the engine holds (maybe shared): never written; nor past ``end``."""
    store, ids, kv = _store(MemoryTier(None))
    sink, layers, blocks = _paged_sink(len(ids))
    start, end = 16, 112  # inside chunk 0 and inside chunk 3
    result = store.prefix_load(ids, sink, start=start, end=end).start().finish()
    assert result.complete and result.loaded_end == end
    for paged, layer in zip(layers, kv.layers):
        k, v = read_paged(paged, slot_mapping(blocks, 0, len(ids), BS), "cpu")
        assert torch.equal(k[:, start:end], layer.keys[:, start:end]) and torch.equal(v[:, start:end], layer.values[:, start:end])
        assert bool((k[:, :start] == 7).all()) and bool((v[:, end:] == 7).all())


def test_a_missing_chunk_ends_the_load_and_says_so():
    store, ids, _ = _store(MemoryTier(None))
    store.tiers[0].delete(store.keys_for(ids)[2][0])
    result = store.prefix_load(ids, DenseSink()).start().finish()
    assert result.loaded_end == 2 * CHUNK and not result.complete
    assert [c.status for c in result.chunks] == ["loaded", "loaded", "missing", "skipped"]


# --- variants and the planner --------------------------------------------------------------------

def test_every_variant_is_stored_and_found():
    tier = MemoryTier(None)
    store, ids, kv = _store(tier, codec=["cachegen", "raw"])
    assert len(tier.keys()) == 2 * 4 and store.lookup(ids).num_tokens == len(ids)
    sizes = store.source.value_sizes([k for _, _, ks in store.variant_keys(ids) for k in ks])
    assert all(s is not None for s in sizes) and sizes[0][0] < sizes[1][0] / 3  # cachegen, raw of chunk 0
    store.tiers[0].delete(store.variant_keys(ids)[0][2][1])  # raw of chunk 0 gone: cachegen still serves it
    assert store.lookup(ids).num_tokens == len(ids)


def _loaded(store, ids, **planner) -> list[int | str]:
    result = store.prefix_load(ids, DenseSink(), **planner).start().finish()
    return [c.variant if c.status == "loaded" else c.status for c in result.chunks]


class Link(MemoryTier):
    """Memory behind a link of ``rate`` bytes/s that the test can change; every read is logged (key, offset)."""

    def __init__(self, rate: float, round_trip: float = 0.0) -> None:
        super().__init__(None)
        self.rate, self.round_trip, self.reads = rate, round_trip, []

    def get(self, key, max_bytes=None):
        value = super().get(key, max_bytes)
        self.reads.append((key, 0))
        time.sleep(0 if value is None else self.round_trip + len(value) / self.rate)
        return value

    def get_range(self, key, offset, length, max_bytes=None):
        value = MemoryTier.get(self, key, max_bytes)  # (not this link's get: one piece crosses it)
        piece = None if value is None else value[offset:offset + length]
        self.reads.append((key, offset))
        time.sleep(0 if piece is None else self.round_trip + len(piece) / self.rate)
        return piece


def _slow_cachegen(monkeypatch, seconds: float) -> None:
    """cachegen's decode takes ``seconds`` a layer (raw's is a copy)."""
    from kvcodec.codecs.cachegen import CacheGen

    real = CacheGen.decode_layers
    monkeypatch.setattr(CacheGen, "decode_layers",
                        lambda self, datas, ctxs: time.sleep(seconds * len(datas)) or real(self, datas, ctxs))


def test_the_load_stops_where_recomputing_the_rest_is_sooner():
    store, ids, kv = _store(MemoryTier(None), codec=["cachegen", "raw"])
    store.telemetry.decode_rate = lambda codec: Pinned(1e6)  # both decode 1 M tokens/s
    # an engine that recomputes 10 M tokens/s beats any load decoding 1 M/s: nothing is loaded
    assert _loaded(store, ids, recompute_tps=1e7) == ["recompute", "skipped", "skipped", "skipped"]
    # ... one at 100 k tokens/s does not, and without a recompute speed a load never stops
    assert "recompute" not in _loaded(store, ids, recompute_tps=1e5) + _loaded(store, ids)


def test_a_load_of_one_variant_stops_where_recomputing_the_rest_is_sooner():
    """Regression: with one variant stored the load read every chunk whatever the engine's speed; a fused prompt's
    raw segments at 100 Mbit/s took 15 s to load against 7.8 s for the model to compute them (segment_reuse)."""
    store, ids, _ = _store(MemoryTier(None), codec="raw")
    store.telemetry.decode_rate = lambda codec: Pinned(1e6)
    assert _loaded(store, ids, recompute_tps=1e7) == ["recompute", "skipped", "skipped", "skipped"]
    assert "recompute" not in _loaded(store, ids, recompute_tps=1e5) + _loaded(store, ids)


def _behind_link(monkeypatch, raw_s: float, cachegen_s: float, chunks: int = 4) -> tuple[KVStore, list[int], KVCache]:
    """``chunks`` float32 chunks kept as cachegen and raw (6x its bytes, as for a float32 model) behind a
    :class:`Link` that takes ``raw_s`` per raw chunk; cachegen takes ``cachegen_s`` a chunk to decode; the store
    has learnt both."""
    store = KVStore([MemoryTier(None)], model="m", codec=["cachegen", "raw"], chunk_tokens=CHUNK)
    ids, kv = list(range(1000, 1000 + chunks * CHUNK)), _kv(chunks * CHUNK)
    kv = KVCache([(l.keys.float(), l.values.float()) for l in kv.layers], model="m")
    store.put(ids, kv)
    raw_bytes = store.source.value_sizes(store.variant_keys(ids)[0][2])[1][0]
    link = Link(raw_bytes / raw_s)
    for key in [k for _, _, ks in store.variant_keys(ids) for k in ks]:
        link.put(key, store.tiers[0].get(key))
    learnt = Measured(link.rate)
    learnt.observe(int(link.rate), 1.0)  # timed by this process just now
    store.tiers[0], store.telemetry.links = link, {link.name: learnt}
    store.telemetry.loads_planned = 1  # a store that has loaded before (a process's first load is planned apart)
    _slow_cachegen(monkeypatch, cachegen_s / LAYERS)
    store.telemetry.decode_rate = lambda codec: Pinned(CHUNK / cachegen_s if codec.codec_id == "cachegen" else 1e9)
    return store, ids, kv


@pytest.mark.parametrize("variants", [["cachegen", "raw"], ["raw"]])
def test_a_load_checks_a_slow_estimate_before_handing_everything_to_the_engine(monkeypatch, variants):
    """Regression: inside vLLM, after a request at 20 Mbit/s, the link back at 1 Gbit/s was still taken for
    20 Mbit/s request after request: each load found recomputing sooner on that estimate, so no read measured the
    link again.  Now a load reads a piece first, sees the link, and loads."""
    if variants == ["raw"]:
        store, ids, _ = _store(Link(1e9), codec="raw")
        store.tiers[0].rate = store.source.value_sizes([store.variant_keys(ids)[0][2][0]])[0][0] / 0.010
    else:
        store, ids, _ = _behind_link(monkeypatch, raw_s=0.010, cachegen_s=0.030)
    link = store.tiers[0]
    for _ in range(4):  # a fresh estimate of a link 1000x slower than it is now
        store.telemetry.link(link.name).throughput.observe(link.rate / 1000, 1.0)
    recompute_tps = len(ids) / 0.5  # the engine: 0.5 s for the prompt; raw over the link: 40 ms
    loaded = _loaded(store, ids, recompute_tps=recompute_tps)
    assert "recompute" not in loaded, loaded
    assert store.telemetry.link(link.name).throughput.estimate > link.rate / 10
    # a link as slow as estimated (raw 0.2 s a chunk) and an engine that computes the prompt in 20 ms: one piece
    # read, then the engine's
    link.rate /= 20
    store.telemetry.links = {link.name: Measured(link.rate)}
    for _ in range(4):
        store.telemetry.link(link.name).throughput.observe(link.rate, 1.0)
    reads = len(link.reads)
    assert _loaded(store, ids, recompute_tps=len(ids) / 0.02)[0] == "recompute"
    assert len(link.reads) - reads <= 2


def _raw_chunks_behind(link: Link, chunk_s: float) -> tuple[KVStore, list[int], int]:
    """Four 256-token raw chunks of 1.5 MB behind ``link``, which is set to take ``chunk_s`` per chunk; raw decodes
    at once.  The store, the prompt and a chunk's bytes."""
    g = torch.Generator().manual_seed(0)
    kv = KVCache([(torch.randn(8, 1024, 64, generator=g).half(), torch.randn(8, 1024, 64, generator=g).half())
                  for _ in range(3)], model="m")
    store = KVStore([link], model="m", codec="raw", chunk_tokens=256)
    ids = list(range(1000, 2024))
    store.put(ids, kv)
    chunk_bytes = store.source.value_sizes([store.variant_keys(ids)[0][2][0]])[0][0]
    link.rate = chunk_bytes / chunk_s
    store.telemetry.decode_rate = lambda codec: Pinned(1e9)
    return store, ids, chunk_bytes


def test_a_probe_piece_as_short_as_a_round_trip_is_followed_by_one_that_times_the_link():
    """Regression (bench/vllm_link.py): a fresh engine whose predecessor measured 100 Mbit/s, on a link back at
    1 Gbit/s, handed every raw load to vLLM.  Its 32 KiB probe piece took about a round trip, which looked no faster
    than the old estimate.  Here 1.5 MB chunks cross a link in 4 ms plus a 3 ms round trip; the store remembers a
    link 50x slower, at which recomputing (0.4 s) is sooner.  The load reads a 160 KiB piece after the short one,
    sees the link, and loads."""
    link = Link(1.0, round_trip=0.003)
    store, ids, _ = _raw_chunks_behind(link, chunk_s=0.004)
    store.telemetry.link(link.name).throughput.prior = link.rate / 50  # restored from a predecessor: not timed
    assert _loaded(store, ids, recompute_tps=len(ids) / 0.4) == [0, 0, 0, 0]
    assert store.telemetry.link(link.name).throughput.estimate > link.rate / 20


def test_a_load_of_one_variant_gives_up_a_chunk_whose_rest_would_come_later_than_recomputing_it():
    """Regression (bench/vllm_link.py): a fresh raw engine at 20 Mbit/s, whose estimate was a faster link's, read its
    first 256-token chunk whole (4.7 s) before it handed the prompt to vLLM: 13.1 s to the first token against
    8.6 s recomputing.  Here a chunk takes 1 s on a link the store has just measured 50x faster, and the engine
    computes the prompt in 0.3 s.  The load gives the first chunk up after one piece and hands the prompt over."""
    link = Link(1.0)
    store, ids, chunk_bytes = _raw_chunks_behind(link, chunk_s=1.0)
    learnt = Measured(link.rate * 50)
    learnt.observe(int(link.rate * 50), 1.0)  # timed by this process just now
    store.telemetry.links = {link.name: learnt}
    t0 = time.perf_counter()
    result = store.prefix_load(ids, DenseSink(), recompute_tps=len(ids) / 0.3).start().finish()
    took = time.perf_counter() - t0
    assert [c.status for c in result.chunks] == ["recompute", "skipped", "skipped", "skipped"]
    assert took < 0.5 and result.wasted_bytes < chunk_bytes / 2, (took, result.wasted_bytes)
    # a link as fast as measured: every chunk loads, in pieces
    link.rate *= 50
    assert _loaded(store, ids, recompute_tps=len(ids) / 0.3) == [0, 0, 0, 0]
    assert len({offset for _, offset in link.reads}) > 1


def test_two_variants_load_from_both_ends(monkeypatch):
    """raw takes 30 ms a chunk on the link, cachegen 30 ms a chunk to decode: the link brings raw for the first
    chunks while the decoder works back from the last through cachegen, sooner than either alone."""
    store, ids, kv = _behind_link(monkeypatch, raw_s=0.030, cachegen_s=0.030)
    sink = DenseSink()
    t0 = time.perf_counter()
    result = store.prefix_load(ids, sink).start().finish()
    took = time.perf_counter() - t0
    variants = [c.variant for c in result.chunks]
    assert result.complete and variants[0] == 1 and variants[-1] == 0, variants
    assert variants == sorted(variants, reverse=True)  # raw from the front, cachegen from the back
    assert took < 4 * 0.030, took  # raw alone: 4 x 30 ms on the link, cachegen 4 x 30 ms of decoding, and more
    for mine, theirs in zip(sink.cache().layers, kv.layers):  # each chunk where it belongs, raw ones exact
        for c in result.chunks:
            got, want = mine.keys[:, c.start:c.end].float(), theirs.keys[:, c.start:c.end].float()
            assert torch.equal(got, want) if c.variant == 1 else (got - want).abs().max() < 0.5


class Slowdown(Contention):
    """A contention the loads' own reads do not move."""

    def __init__(self, slowdown: float) -> None:
        super().__init__()
        self.pinned = slowdown

    def slowdown(self, bps: float) -> float:
        return self.pinned


@pytest.mark.parametrize("slowdown, smalls", [(1.0, True), (3.0, False)])
def test_a_small_variant_is_decoded_only_where_it_saves_the_link_more_than_it_slows_it(monkeypatch, slowdown, smalls):
    """raw takes 10 ms a chunk on the link, cachegen 30 ms to decode.  Where a decode does not slow the link, the
    decoder works back through cachegen while raw comes; where it slows it 3x (30 ms of decoding cost the link
    20 ms, more than the 10 ms raw chunk it saves), every chunk comes raw."""
    store, ids, _ = _behind_link(monkeypatch, raw_s=0.010, cachegen_s=0.030)
    for link in store.telemetry.links.values():
        link.contention = Slowdown(slowdown)
    result = store.prefix_load(ids, DenseSink()).start().finish()
    variants = [c.variant for c in result.chunks]
    assert result.complete and (0 in variants) == smalls, variants


@pytest.mark.parametrize("raw_s, smalls", [(0.010, False), (0.100, True)])
def test_a_processs_first_load_decodes_a_small_variant_only_where_it_pays_with_the_link_stopped(monkeypatch, raw_s,
                                                                                                 smalls):
    """Regression: inside vLLM over a 10 Gbit/s or unshaped link a fresh engine's first load decoded kvtc on the
    contention its predecessors had measured (1.04x), while the engine's own first step took the cores (the decode
    took 3x its estimate, raw reads beside it 5-14x longer): 1.07-1.27x raw's time.  A first load now counts a small
    decode as stopping the link: with raw at 10 ms a chunk and cachegen's decode at 30 ms every chunk comes raw, and
    the next load decodes from the back again; with raw at 100 ms a chunk the first load decodes cachegen too."""
    store, ids, _ = _behind_link(monkeypatch, raw_s=raw_s, cachegen_s=0.030)
    for link in store.telemetry.links.values():
        link.contention = Slowdown(1.0)
    store.telemetry.loads_planned = 0
    first = store.prefix_load(ids, DenseSink()).start().finish()
    assert first.complete and (0 in [c.variant for c in first.chunks]) == smalls, first.chunks
    assert any(c.decision.slowdown == float("inf") for c in first.chunks)
    then = store.prefix_load(ids, DenseSink()).start().finish()
    assert then.complete and 0 in [c.variant for c in then.chunks]


def test_contention_pairs_reads_close_in_time_at_the_link_speed_asked_about(monkeypatch):
    clock = iter([0.0, 0.01, 0.02, 0.03, 5.0, 5.01, 6.0, 6.01]).__next__
    monkeypatch.setattr("kvcodec.store.telemetry.time.perf_counter", clock)
    contention = Contention()
    assert contention.slowdown(100) == 1.0  # unmeasured
    contention.observe(100, 1.0, beside_decode=False)
    assert contention.slowdown(100) == 1.0  # half measured
    contention.observe(100, 2.5, beside_decode=True)  # 10 ms later: a pair at 100 B/s alone, ratio 2.5
    assert contention.slowdown(100) == pytest.approx(2.5) and contention.slowdown(1000) == 1.0
    contention.observe(100, 1.0, beside_decode=False)  # pairs with the last one beside a decode
    contention.observe(100, 0.5, beside_decode=True)  # faster beside a decode: ratio 0.5
    assert contention.slowdown(100) == pytest.approx(2.5)  # the median of 2.5, 2.5 and 0.5
    contention.observe(100, 100.0, beside_decode=True)  # 5 s later (the link dropped meanwhile): no pair
    contention.observe(100, 0.1, beside_decode=False)  # pairs: 1000 B/s alone, ratio 1000
    assert contention.slowdown(100) == pytest.approx(2.5) and contention.slowdown(1000) == pytest.approx(1000)
    contention.observe(1000, 1.0, beside_decode=False)  # 1 s after the last: no pair
    contention.observe(1000, 1.0, beside_decode=True)  # ratio 1 at 1000 B/s
    assert contention.slowdown(1500) == pytest.approx(500.5)


def test_a_link_that_drops_mid_request_costs_at_most_the_read_under_way(monkeypatch):
    """The link brings raw at 100 MB/s, then (after two chunks) drops to 20 kB/s: the load does not wait for the
    raw chunk it was reading (0.6 s) but decodes the small variants it already holds."""
    store, ids, _ = _store(MemoryTier(None), codec=["cachegen", "raw"])
    link = Link(1e8)
    for key in [k for _, _, ks in store.variant_keys(ids) for k in ks]:
        link.put(key, store.tiers[0].get(key))
    store.tiers[0], store.telemetry.links = link, {link.name: Measured(link.rate)}
    _slow_cachegen(monkeypatch, 0.020 / LAYERS)
    raw_keys = {ks[1] for _, _, ks in store.variant_keys(ids)}
    real_get_range = Link.get_range

    def dropping(key, offset, length, max_bytes=None):
        if key in raw_keys and len({k for k, _ in link.reads if k in raw_keys}) > 2:
            link.rate = 2e4
        return real_get_range(link, key, offset, length, max_bytes)

    link.get_range = dropping
    monkeypatch.setattr("kvcodec.store.load.PIECE_BYTES", (1024, 1024))  # this test's chunks are small: 50 ms a piece
    t0 = time.perf_counter()
    result = store.prefix_load(ids, DenseSink()).start().finish()
    took = time.perf_counter() - t0
    assert result.complete and [c.variant for c in result.chunks][-1] == 0
    assert took < 0.3, took


def test_two_variants_mixed_keep_both_stages_busy():
    """A variant that is dear on the link (raw: 10 ms to fetch, nothing to decode) and one dear to decode (10 ms)
    load four chunks in 40 ms either way alone, and in about half that mixed: the bound the planner estimates a
    load's end with."""
    stages = [(0.010, 0.0), (0.001, 0.010)]
    assert finish_s(0, 0, 4, stages[:1]) == pytest.approx(0.040) and finish_s(0, 0, 4, stages[1:]) == pytest.approx(0.040)
    assert finish_s(0, 0, 4, stages) < 0.6 * 0.040
    assert finish_s(0.005, 0.030, 0, stages) == 0.030  # nothing more to load: the later stage's end


def test_planner_options_are_checked():
    store, _, _ = _store(MemoryTier(None))
    with pytest.raises(Exception, match="recompute_tps"):
        LoadPlanner(store.telemetry, store.variants, recompute_tps=0)


def test_a_joint_codec_decodes_whole_chunks_straight_into_paged_memory(monkeypatch):
    """kvtc codes a chunk's layers together: whole chunks go through its frame-wise paged decode, a chunk cut by
    ``start`` through the dense one; both land where the dense decode puts them."""
    from kvcodec.codecs.kvtc import KVTC, register_calibration
    from kvcodec.tools.fuzz.seeds import fuzz_calibration

    kv = _kv(4 * CHUNK)
    kv = KVCache([(l.keys, l.values) for l in kv.layers], model="m", rope="post")
    cal = register_calibration(fuzz_calibration(kv))
    store = KVStore([MemoryTier(None)], model="m", codec="kvtc", codec_options={"calibration": cal.digest},
                    chunk_tokens=CHUNK)
    ids = list(range(1000, 1000 + 4 * CHUNK))
    store.put(ids, kv)
    fused = []
    real = KVTC.decode_frame_paged
    monkeypatch.setattr(KVTC, "decode_frame_paged", lambda self, *a, **k: fused.append(1) or real(self, *a, **k))
    dense = store.get(ids)
    sink, layers, blocks = _paged_sink(len(ids))
    assert store.prefix_load(ids, sink, start=16).start().finish().complete
    assert len(fused) == 3  # chunks 1-3; chunk 0 starts before the load
    for paged, layer in zip(layers, dense.layers):
        k, v = read_paged(paged, slot_mapping(blocks, 0, len(ids), BS), "cpu")
        assert torch.equal(k[:, 16:], layer.keys[:, 16:]) and torch.equal(v[:, 16:], layer.values[:, 16:])


def test_a_store_switches_codec_and_old_chunks_miss_rather_than_mix():
    store, ids, kv = _store(MemoryTier(None), codec="cachegen")
    assert store.lookup(ids).num_tokens == len(ids)
    store.use_codec("raw")
    assert store.codec.codec_id == "raw" and store.lookup(ids).num_tokens == 0  # cachegen's keys are not raw's
    store.put(ids, kv)
    got = store.get(ids)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(got.layers, kv.layers))


def test_contention_is_measured_over_a_values_whole_read_and_check_not_its_pieces(monkeypatch):
    """Regression: inside vLLM at 10 Gbit/s a kvtc decode took the fetch thread's work per raw chunk from 35 ms to
    90-110 ms, mostly in checking each value, while its pieces of 1-10 ms beside the decode looked no slower (every
    pair a load kept measured under 1): the decode looked free, and adaptive loads decoded kvtc where raw alone was
    sooner.  Here a raw chunk's reads take 30 ms either way and its check 2 ms, or 50 ms beside cachegen's 200 ms
    decode: the loads must measure the whole read and check slowed (80 ms against 32), and then read every chunk
    raw (its 30 ms are less than what the decode would cost the link)."""
    from kvcodec.codecs.cachegen import CacheGen
    from kvcodec.store.source import ChunkSource

    store, ids, _ = _behind_link(monkeypatch, raw_s=0.030, cachegen_s=0.200, chunks=8)
    decoding = threading.Event()
    decode = CacheGen.decode_layers

    def slow_decode(self, datas, ctxs):
        decoding.set()
        try:
            return decode(self, datas, ctxs)
        finally:
            decoding.clear()

    monkeypatch.setattr(CacheGen, "decode_layers", slow_decode)
    check = ChunkSource.check
    monkeypatch.setattr(ChunkSource, "check",
                        lambda self, *a, **k: time.sleep(0.050 if decoding.is_set() else 0.002) or check(self, *a, **k))
    link = store.telemetry.link(store.tiers[0].name)
    first = store.prefix_load(ids, DenseSink()).start().finish()
    assert first.complete and first.chunks[-1].variant == 0  # cachegen decoded from the back: contention measured
    ratios = [r for _, r in link.contention.pairs]
    assert ratios and min(ratios) > 2, link.contention.pairs
    then = store.prefix_load(ids, DenseSink()).start().finish()
    assert then.complete and [c.variant for c in then.chunks] == [1] * (len(ids) // CHUNK)
