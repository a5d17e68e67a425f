"""Bandwidth adaptation: estimator, traces, policy, simulator and fetcher, on hand-made bandwidth traces."""

from __future__ import annotations

import math

import pytest
import torch

import kvcodec
from kvcodec.store.telemetry import RateEstimator
from kvcodec.tools.adaptation import (RECOMPUTE, AdaptationPolicy, BandwidthTrace, ChunkTable, Decision, compare, fetch,
                                      simulate)

LEVELS3 = [1000, 2000, 4000]  # bytes of one chunk at levels 0, 1, 2


def table(n: int = 10, row=LEVELS3, tokens: int = 10) -> ChunkTable:
    """``n`` chunks of ``tokens`` tokens each (token ids: 4 bytes a token)."""
    return ChunkTable.from_sizes([row] * n, chunk_tokens=tokens)


class Scripted(AdaptationPolicy):
    """Decisions given in advance, to pin down the simulator's model of time."""

    def __init__(self, decisions, *args, **kw):
        super().__init__(*args, **kw)
        self.script = decisions

    def decide(self, i, now_s, estimate, *, compute_ready_s=None):
        return self.script[i]


# ------------------------------------------------------------------------------------------------ estimator

def test_estimator_prior_then_windowed_harmonic_mean():
    e = RateEstimator(prior=50.0, window=2)
    assert e.estimate == 50.0 and e.samples == ()
    e.observe(100, 1.0)                      # 100 B/s; the prior is dropped
    assert e.estimate == pytest.approx(100.0, rel=1e-12)
    e.observe(100, 0.5)                      # 200 B/s
    assert e.estimate == pytest.approx(2 / (1 / 100 + 1 / 200), rel=1e-12)  # 133.33, not the arithmetic 150
    e.observe(300, 1.0)                      # 300 B/s pushes 100 out of the window
    assert e.samples == (200.0, 300.0)
    assert e.estimate == pytest.approx(240.0, rel=1e-12)
    e.observe(0, 0.0)                        # carries no throughput: ignored
    e.observe(0, 1.0)
    assert e.samples == (200.0, 300.0)


def test_estimator_equal_chunks_is_total_bytes_over_total_time():
    e = RateEstimator(1.0, window=3)
    for seconds in (1.0, 4.0, 2.5):
        e.observe(1000, seconds)
    assert e.estimate == pytest.approx(3000 / 7.5, rel=1e-12)


def test_estimator_rejects_bad_input():
    with pytest.raises(kvcodec.InvalidInputError):
        RateEstimator(1.0, window=0)
    with pytest.raises(kvcodec.InvalidInputError):
        RateEstimator(prior=0)
    with pytest.raises(kvcodec.InvalidInputError):
        RateEstimator(1.0).observe(-1, 1.0)


# ------------------------------------------------------------------------------------------------ traces

def test_trace_transfer_integrates_the_rate():
    tr = BandwidthTrace([(0, 100), (1, 50), (3, 200)])
    assert tr.transfer_end(0, 150) == pytest.approx(2.0)       # 100 B in the first second, 50 B at 50 B/s
    assert tr.transfer_end(0.5, 50) == pytest.approx(1.0)      # inside one segment
    assert tr.transfer_end(0, 400) == pytest.approx(4.0)       # 200 B by t=3, then 200 B at 200 B/s
    assert tr.transfer_end(10, 400) == pytest.approx(12.0)     # the last segment lasts forever
    assert tr.transfer_end(2, 0) == 2
    assert tr.rate_at(0.99) == 100 and tr.rate_at(1) == 50 and tr.rate_at(99) == 200
    assert tr.mean_rate(0, 3) == pytest.approx(200 / 3)


def test_trace_outage_and_validation():
    tr = BandwidthTrace([(0, 100), (1, 0), (2, 100)])
    assert tr.transfer_end(0.5, 100) == pytest.approx(2.5)     # 50 B, a one-second outage, 50 B
    for bad in ([(1, 100)], [(0, 100), (0, 50)], [(0, 100), (1, 0)], [(0, -1), (1, 5)]):
        with pytest.raises(kvcodec.InvalidInputError):
            BandwidthTrace(bad)


def test_jittery_trace_is_deterministic_per_seed():
    a = BandwidthTrace.jittery(1e6, 2.0, 0.1, seed=7)
    b = BandwidthTrace.jittery(1e6, 2.0, 0.1, seed=7)
    c = BandwidthTrace.jittery(1e6, 2.0, 0.1, seed=8)
    assert a.segments == b.segments and a.segments != c.segments
    assert len(a.segments) == 20 and len({r for _, r in a.segments}) == 20
    p = AdaptationPolicy(table(), 0.2, 10.0)
    assert simulate(p, a).records == simulate(p, b).records


# ------------------------------------------------------------------------------------------------ policy

def test_steady_high_bandwidth_gives_the_best_level_everywhere():
    p = AdaptationPolicy(table(), 1.0, recompute_s=1.0)
    res = simulate(p, BandwidthTrace.steady(1e6))
    assert res.levels == [2] * 10
    assert res.ttft_s == pytest.approx(10 * 4000 / 1e6) and res.met_budget
    assert res.histogram == {"L2": 10}


def test_bandwidth_drop_steps_levels_down_after_it_is_seen_and_back_up():
    # 100 kB/s, except 10 kB/s during [0.16, 0.36): chunk 4 (sent from 0.16) is caught in the drop
    trace = BandwidthTrace([(0, 1e5), (0.16, 1e4), (0.36, 1e5)])
    res = simulate(AdaptationPolicy(table(12), 0.9, recompute_s=10.0), trace, RateEstimator(1e5, window=3))
    # chunk 4 was decided before the drop could be seen; chunk 5 right after the slow sample; chunk 8 once the
    # slow sample has left the 3-chunk window (4000 B in 0.22 s: estimate 3 / (2/1e5 + 0.22/4000) = 40 kB/s)
    assert res.level_string() == "222221112222"
    assert res.records[5].estimate_bps == pytest.approx(40000.0)
    assert res.records[8].estimate_bps == pytest.approx(1e5)
    assert res.arrivals[4] == pytest.approx(0.38)
    assert res.met_budget and res.ttft_s == pytest.approx(0.60)
    # in hindsight level 2 throughout would have fit (the drop ends); the policy cannot know that, so it sends
    # less than level 2 but more than level 1
    fixed = [simulate(AdaptationPolicy(table(12), 0.9, 10.0).fixed(k), trace) for k in range(3)]
    assert [f.ttft_s for f in fixed] == pytest.approx([0.12, 0.42, 0.66])
    assert fixed[1].bytes_sent < res.bytes_sent < fixed[2].bytes_sent


def test_very_low_bandwidth_with_cheap_recompute_recomputes():
    tab = table(10)                                    # token ids: 10 tokens x 4 B = 40 B per chunk
    res = simulate(AdaptationPolicy(tab, 1.0, recompute_s=0.01), BandwidthTrace.steady(1000),
                   RateEstimator(1000))
    assert all(d == RECOMPUTE and d.recompute for d in res.decisions)
    # ids of chunk i arrive at 0.04 (i+1); each recompute (0.01 s) is shorter than the next ids transfer
    assert res.ttft_s == pytest.approx(0.41)
    assert res.bytes_sent == 400 and res.met_budget and math.isnan(res.bits_per_element)
    # the same link with expensive recompute: smallest level (nothing fits a 1 s budget), never recompute
    res2 = simulate(AdaptationPolicy(tab, 1.0, recompute_s=2.0), BandwidthTrace.steady(1000), RateEstimator(1000))
    assert res2.levels == [0] * 10 and not res2.met_budget


def test_recompute_boundary_compares_arrival_times():
    p = AdaptationPolicy([[1000, 2000]], 100.0, recompute_s=0.9, token_id_bytes=0)
    assert p.decide(0, 0.0, 1000.0) == RECOMPUTE                       # 0.9 s recompute < 1.0 s transfer
    assert AdaptationPolicy([[1000, 2000]], 100.0, 1.1, token_id_bytes=0).decide(0, 0.0, 1000.0).level == 1
    # the compute device is busy (or the prefix is not ready) until t=0.2: recompute ends at 1.1 > 1.0
    assert p.decide(0, 0.0, 1000.0, compute_ready_s=0.2).level == 1
    # token ids count too: 40 B at 1000 B/s delay the recompute start to 0.04 + 0.9 < 1.0, still recompute;
    # with 1000 tokens (4000 B of ids) it no longer pays
    assert AdaptationPolicy(ChunkTable.from_sizes([[1000, 2000]], 10), 100.0, 0.9).decide(0, 0, 1000.0).recompute
    assert not AdaptationPolicy(ChunkTable.from_sizes([[1000, 2000]], 1000), 100.0, 0.9).decide(0, 0, 1000.0).recompute


def test_remaining_budget_is_shared_by_the_remaining_chunks():
    p = AdaptationPolicy(table(4), 10.0, recompute_s=100.0)
    # at 1000 B/s: all four at level 2 take 16 s, at level 1 8 s: level 1, though chunk 0 alone at level 2 fits
    assert p.decide(0, 0.0, 1000.0) == Decision(1)
    assert p.remaining_s(0, 2, 1000.0) == pytest.approx(16.0)
    # the last chunk with 4.5 s left: level 2 (4 s) fits; with 3.5 s left: level 1 (2 s)
    assert p.decide(3, 5.5, 1000.0).level == 2
    assert p.decide(3, 6.5, 1000.0).level == 1
    # two chunks left with 5 s: level 1 (4 s) but not level 2 (8 s)
    assert p.decide(2, 5.0, 1000.0).level == 1
    # nothing fits: the smallest level
    d = AdaptationPolicy(table(4), 3.0, 100.0).decide(0, 0.0, 1000.0)
    assert d.level == 0 and "nothing fits" in d.reason


def test_decode_time_counts_against_the_budget():
    p = AdaptationPolicy(table(4), 10.0, recompute_s=100.0, decode_s_per_byte=1e-3)
    # level 1: transfer 8 s + decode of the last chunk 2 s = 10 s fits; level 2 does not
    assert p.remaining_s(0, 1, 1000.0) == pytest.approx(10.0)
    assert p.decide(0, 0.0, 1000.0).level == 1
    # decode slower than the link: bounded by the first transfer plus every decode
    slow = AdaptationPolicy(table(4), 100.0, 100.0, decode_s_per_byte=5e-3)
    assert slow.remaining_s(0, 0, 1000.0) == pytest.approx(1.0 + 4 * 5.0)
    res = simulate(slow.fixed(0), BandwidthTrace.steady(1000))
    assert res.ttft_s == pytest.approx(21.0)


def test_budget_respected_whenever_feasible_on_a_steady_link():
    rows = [[900, 2100, 3900], [1200, 1800, 4400], [800, 2500, 3000], [1000, 2000, 4100], [1100, 1900, 3700]] * 2
    tab = ChunkTable.from_sizes(rows, chunk_tokens=10)
    checked = 0
    for bw in (2000.0, 5000.0, 1e4, 3e4):
        for budget in (0.5, 1.0, 2.0, 3.0, 5.0, 8.0):
            feasible = tab.level_bytes(0) / bw <= budget
            p = AdaptationPolicy(tab, budget, recompute_s=1e3)
            res = simulate(p, BandwidthTrace.steady(bw), RateEstimator(bw))
            if not feasible:
                assert res.levels == [0] * 10
                continue
            checked += 1
            assert res.met_budget, (bw, budget, res.level_string())
            assert res.levels == sorted(res.levels)            # on a steady link levels only rise
            best_fixed = max((simulate(p.fixed(k), BandwidthTrace.steady(bw)) for k in range(3)),
                             key=lambda r: (r.met_budget, r.bytes_sent))
            assert res.bytes_sent >= best_fixed.bytes_sent     # at least the best fixed level that fits
    assert checked >= 12


def test_prefix_causal_recompute_waits_and_overlaps_transfers():
    tab = table(2, row=[1000])
    # chunk 0 arrives at 1.0; recomputing chunk 1 waits for it: ids at 1.04, done at 1.14
    p = Scripted([Decision(0), RECOMPUTE], tab, 10.0, recompute_s=0.1)
    res = simulate(p, BandwidthTrace.steady(1000))
    assert [r.ready_s for r in res.records] == pytest.approx([1.0, 1.14])
    # recomputing chunk 0 (ids at 0.04, done 0.54) overlaps the transfer of chunk 1 (0.04 to 1.04)
    p = Scripted([RECOMPUTE, Decision(0)], tab, 10.0, recompute_s=0.5)
    res = simulate(p, BandwidthTrace.steady(1000))
    assert [r.ready_s for r in res.records] == pytest.approx([0.54, 1.04])
    assert res.records[1].start_s == pytest.approx(0.04)


def test_baselines_and_compare():
    p = AdaptationPolicy(table(8), 0.5, recompute_s=0.05)
    results = compare(p, BandwidthTrace.steady(4e4), lambda: RateEstimator(4e4))
    assert [r.policy for r in results] == ["adaptive", "always L0", "always L1", "always L2", "recompute all"]
    assert [r.ttft_s for r in results[1:4]] == pytest.approx([0.2, 0.4, 0.8])
    assert results[4].ttft_s == pytest.approx(8 * 0.05 + 40 / 4e4)   # serial recompute; last ids arrive first
    assert results[4].levels == [-1] * 8
    assert results[0].met_budget and results[0].bytes_sent > results[2].bytes_sent


def test_bad_arguments():
    with pytest.raises(kvcodec.InvalidInputError):
        ChunkTable.from_sizes([[1, 2], [3]])
    with pytest.raises(kvcodec.InvalidInputError):
        ChunkTable.from_sizes([[0, 2]])
    with pytest.raises(kvcodec.InvalidInputError):
        AdaptationPolicy(table(), 0.0, 1.0)
    with pytest.raises(kvcodec.InvalidInputError):
        AdaptationPolicy(table(), 1.0, 1.0).decide(0, 0.0, 0.0)
    with pytest.raises(kvcodec.InvalidInputError):
        AdaptationPolicy(table(), 1.0, 1.0).fixed(3)


def test_safety_margin_plans_with_part_of_the_estimate():
    p = AdaptationPolicy(table(4), 10.0, 100.0, safety=0.5)
    assert p.decide(0, 0.0, 2000.0).level == 1       # plans with 1000 B/s: as in the test above
    assert AdaptationPolicy(table(4), 10.0, 100.0).decide(0, 0.0, 2000.0).level == 2


# ------------------------------------------------------------------------------------------------ real container

@pytest.fixture(scope="module")
def container():
    g = torch.Generator().manual_seed(0)
    kv = kvcodec.KVCache([(torch.randn(2, 100, 16, generator=g).half(), torch.randn(2, 100, 16, generator=g).half())
                          for _ in range(4)], token_ids=list(range(100)))
    codecs = [kvcodec.get_codec("kivi", bits=b) for b in (2, 4, 8)]
    return kv, kvcodec.encode(kv, codecs, chunk_tokens=32, chunk_layers=2)


def test_policy_from_a_real_multilevel_container(container):
    kv, blob = container
    reader = kvcodec.open(blob)
    tab = ChunkTable.from_reader(reader)
    assert tab.num_chunks == 4 and tab.num_levels == 3
    assert tab.token_starts == (0, 32, 64, 96) and tab.token_counts == (32, 32, 32, 4)
    assert [n.split(":")[0] for n in tab.level_names] == ["kivi"] * 3 and "bits=8" in tab.level_names[2]
    for i, t0 in enumerate(tab.token_starts):
        for v in range(3):   # two layer groups per chunk
            frames = [e.length for e in reader.chunks if e.token_start == t0 and e.variant == v]
            assert len(frames) == 2 and tab.sizes[i][v] == sum(frames)
        assert tab.sizes[i][0] < tab.sizes[i][1] < tab.sizes[i][2]
    assert sum(tab.elements) == kv.num_elements == 4 * 2 * 100 * 32
    # the policy built from the reader behaves like the one built from the table
    for bw, want in ((1e9, [2] * 4), (tab.level_bytes(1) / 0.01 * 1.01, None)):
        a = simulate(AdaptationPolicy(reader, 0.01, 1.0), BandwidthTrace.steady(bw), RateEstimator(bw))
        b = simulate(AdaptationPolicy(tab, 0.01, 1.0), BandwidthTrace.steady(bw), RateEstimator(bw))
        assert a.records == b.records and a.met_budget
        if want:
            assert a.levels == want
    mid = simulate(AdaptationPolicy(reader, 0.01, 1.0), BandwidthTrace.steady(tab.level_bytes(1) / 0.01 * 1.01),
                   RateEstimator(tab.level_bytes(1) / 0.01 * 1.01))
    assert 1 in mid.levels and 0 not in mid.levels and mid.levels != [2] * 4
    n = sum(tab.elements)
    assert 8 * tab.level_bytes(0) / n < mid.bits_per_element < 8 * tab.level_bytes(2) / n


def test_fetch_reads_only_the_chosen_levels(container):
    kv, blob = container
    reader = kvcodec.open(blob)
    best = kvcodec.decode(blob)
    # every chunk at its best level is what a plain decode gives; every chunk at level 0 is not
    full = fetch(reader, [2, 2, 2, 2])
    assert not full.missing
    for (k, v), (bk, bv) in zip(full.kv.layers, best.layers):
        assert torch.equal(k, bk) and torch.equal(v, bv)
    low = fetch(reader, [0, 0, 0, 0])
    assert not torch.equal(low.kv.layers[0].keys, best.layers[0].keys)
    assert low.nbytes < full.nbytes == sum(e.length for e in reader.chunks if e.variant == 2)

    mixed = fetch(reader, [Decision(2), RECOMPUTE, RECOMPUTE, 0])
    assert mixed.missing == [(32, 64)]
    assert [(a, b) for a, b, _ in mixed.pieces] == [(0, 32), (96, 100)]
    with pytest.raises(kvcodec.InvalidInputError):
        mixed.kv
    for (t0, t1, piece), level in zip(mixed.pieces, (2, 0)):
        for layer in range(4):
            idx = next(j for j, e in enumerate(reader.chunks) if e.token_start == t0 and e.variant == level
                       and e.layer_start <= layer < e.layer_start + e.layer_count)
            want = reader.read_chunk(idx, layers=[layer]).layers[layer]
            got = piece.layers[layer]
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert mixed.pieces[1][2].token_ids == [96, 97, 98, 99]
    with pytest.raises(kvcodec.InvalidInputError):
        fetch(reader, [2, 2, 2])
