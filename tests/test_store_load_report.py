"""What a load reports (kvcodec.store.load): every byte the tiers served counted once, as used or wasted, and each
chunk's decision with the planner's estimates, in LoadResult and the DEBUG log.  Real SmolLM2 KV, kept as cachegen
in a memory tier and raw behind a slower link."""

from __future__ import annotations

import logging
import re
import time
from collections import Counter

from stand_ins import Pinned

import kvcodec
from kvcodec.codecs.cachegen import CacheGen
from kvcodec.codecs.raw import Raw
from kvcodec.store import DenseSink, KVStore, MemoryTier, plan
from kvcodec.store.source import PlacementPolicy
from kvcodec.store.telemetry import Contention

CHUNK = 128
LINK_BPS = 1e8  # the link's speed, as the planner knows it
PIECE = 256 << 10  # a large value is read in pieces of this many bytes (the least a load reads in)
DROPPED_BPS = PIECE / 0.25  # what the link really gives chunk 2's raw value: 2.9 MB in 2.8 s
CACHEGEN_DECODE_S = 0.5  # cachegen decodes a chunk in this much (a sleep before the real decode, 0.1 s here)
CACHEGEN_TPS = CHUNK / CACHEGEN_DECODE_S  # ... as the store has learnt
DECISION = re.compile(r"^chunk (\d+) \(tokens \d+-\d+\): (\S+) \((.+?)\): ")


class Served(MemoryTier):
    """Memory that counts the bytes it serves per key; reads take ``len / rate`` seconds, those of ``slow_keys``
    ``len / slow_rate`` (None: no delay)."""

    def __init__(self, name: str, rate: float | None = None) -> None:
        super().__init__(None, name=name)
        self.rate, self.slow_rate, self.slow_keys, self.served = rate, None, set(), Counter()

    def _serve(self, key: str, value: bytes | None) -> bytes | None:
        if value:
            self.served[key] += len(value)
            rate = self.slow_rate if key in self.slow_keys else self.rate
            time.sleep(0 if rate is None else len(value) / rate)
        return value

    def get(self, key, max_bytes=None):
        return self._serve(key, super().get(key, max_bytes))

    def get_range(self, key, offset, length, max_bytes=None):
        value = MemoryTier.get(self, key, max_bytes)
        return self._serve(key, None if value is None else value[offset:offset + length])


class PinnedContention(Contention):
    """A decode slows the link ``slowdown`` times, whatever the load's reads measure (here the interpreter's lock
    slows a read beside a real decode, by a varying amount)."""

    def __init__(self, slowdown: float) -> None:
        super().__init__()
        self.pinned = slowdown

    def slowdown(self, bps: float) -> float:
        return self.pinned


def _real(real_kv, tokens: int) -> tuple[list[int], kvcodec.KVCache]:
    kv = kvcodec.KVCache([(l.keys[:, :tokens], l.values[:, :tokens]) for l in real_kv.layers], model=real_kv.model,
                         rope=real_kv.rope)
    return list(real_kv.token_ids[:tokens]), kv


def _two_tiers(real_kv, tokens: int = 4 * CHUNK) -> tuple[KVStore, list[int], Served, Served]:
    """Real KV in cachegen (in a memory tier) and raw (behind a link of ``LINK_BPS``), estimates pinned."""
    ids, kv = _real(real_kv, tokens)
    memory, link = Served("memory"), Served("link", LINK_BPS)
    store = KVStore([memory, link], model=real_kv.model, codec=["cachegen", "raw"], chunk_tokens=CHUNK,
                    policy=PlacementPolicy(put_tiers=["memory"], promote_on_hit=False))
    store.put(ids, kv)
    for _, _, (small, large) in store.variant_keys(ids):
        link.put(large, memory.get(large))
        memory.delete(large)
    memory.served.clear(), link.served.clear()
    for name in ("memory", "link"):
        store.telemetry.link(name).throughput = Pinned(LINK_BPS)
        store.telemetry.link(name).contention = PinnedContention(1.0)
    store.telemetry.decode_rate = lambda codec: Pinned(CACHEGEN_TPS if codec.codec_id == "cachegen" else 1e9)
    store.telemetry.loads_planned = 1  # a store that has loaded before (a process's first load is planned apart)
    return store, ids, memory, link


def _served(*tiers: Served) -> Counter:
    return sum((t.served for t in tiers), Counter())


def _decisions_logged(caplog) -> list[tuple[int, str, str]]:
    return [(int(m.group(1)), m.group(2), m.group(3)) for r in caplog.records
            if r.name == "kvcodec.store.load" and r.levelno == logging.DEBUG and (m := DECISION.match(r.getMessage()))]


def test_a_large_read_given_up_is_wasted_and_every_served_byte_counted_once(real_kv, monkeypatch, caplog):
    """Raw comes from the front over the link while the decoder works back through cachegen; chunk 2's raw read
    crawls (the link gives it 1 MB/s, against the 100 MB/s the planner believes: its first piece shows it), the
    fetch reads the cachegen of chunks 3 and 2 (the decoder could now need them), the decoder decodes them: the raw
    pieces of chunk 2 read are wasted, and the read stops at a piece's end.  Every chunk's used bytes are those of the variant it loaded,
    its wasted bytes those of the others."""
    store, ids, memory, link = _two_tiers(real_kv)
    keys = [ks for _, _, ks in store.variant_keys(ids)]
    link.slow_keys, link.slow_rate = {keys[2][1]}, DROPPED_BPS
    monkeypatch.setattr("kvcodec.store.load.PIECE_BYTES", (PIECE, PIECE))
    real = CacheGen.decode_layers
    monkeypatch.setattr(CacheGen, "decode_layers",  # decodes as slowly as the store has learnt
                        lambda self, datas, ctxs: time.sleep(CACHEGEN_DECODE_S * len(datas) / len(real_kv.layers))
                        or real(self, datas, ctxs))
    with caplog.at_level(logging.DEBUG, logger="kvcodec.store.load"):
        result = store.prefix_load(ids, DenseSink()).start().finish()
    served = _served(memory, link)
    variants = [c.variant for c in result.chunks]
    assert result.complete and variants[0] == 1 and variants[2] == 0, variants
    assert result.nbytes + result.wasted_bytes == sum(served.values())
    for c in result.chunks:
        assert c.nbytes == served[c.keys[c.variant]]
        assert c.wasted_bytes == sum(served[k] for k in c.keys if k != c.keys[c.variant])
    raw_size = len(link.get(keys[2][1]))
    given_up = result.chunks[2]
    assert 0 < given_up.wasted_bytes < raw_size and given_up.wasted_bytes % PIECE == 0  # whole pieces, not all
    assert given_up.decision.rule == plan.LARGE_TOO_LATE
    # raw of chunk 0 was in long before the decoder could have been through its cachegen: never read, nothing wasted
    assert result.chunks[0].wasted_bytes == served[keys[0][0]] == 0 and result.chunks[0].nbytes > 0
    assert result.chunks[0].decision.rule == plan.LARGE_IN_TIME
    for c in result.chunks:  # each decision names the variant loaded, and the estimates it saw
        d = c.decision
        assert d.variant == c.variant and [o.variant for o in d.options] == [0, 1]
        assert d.link_bps == (LINK_BPS, LINK_BPS) and d.decode_tps == (CACHEGEN_TPS, 1e9)
        assert d.slowdown == 1.0 and d.recompute_tps is None
    logged = _decisions_logged(caplog)
    assert sorted(i for i, _, _ in logged) == [0, 1, 2, 3]  # one line per chunk decided
    assert all(name == ("raw", "cachegen")[variants[i] == 0] and rule == result.chunks[i].decision.rule
               for i, name, rule in logged), logged


def test_one_variant_wastes_nothing(real_kv, caplog):
    ids, kv = _real(real_kv, 4 * CHUNK)
    tier = Served("memory")
    store = KVStore([tier], model=real_kv.model, codec="raw", chunk_tokens=CHUNK)
    store.put(ids, kv)
    with caplog.at_level(logging.DEBUG, logger="kvcodec.store.load"):
        result = store.prefix_load(ids, DenseSink()).start().finish()
    assert result.complete and result.wasted_bytes == 0
    assert result.nbytes == sum(tier.served.values()) == sum(len(tier.get(c.key)) for c in result.chunks)
    assert [c.decision.rule for c in result.chunks] == [plan.ONE_VARIANT] * 4
    assert [(i, name) for i, name, _ in _decisions_logged(caplog)] == [(i, "raw") for i in range(4)]


def test_chunks_read_past_a_failed_one_are_wasted(real_kv, monkeypatch):
    """Chunk 1 does not decode (this machine's fault: memory): its bytes and whatever the fetch read after it are
    wasted, chunk 0's used."""
    ids, kv = _real(real_kv, 4 * CHUNK)
    tier = Served("memory")
    store = KVStore([tier], model=real_kv.model, codec="raw", chunk_tokens=CHUNK)
    store.put(ids, kv)
    keys = [k for k, _, _ in store.keys_for(ids)]
    bad = store.source.read(keys[1], CHUNK, 2 * CHUNK).sections[1]
    real = Raw.decode_layer

    def flaky(self, data, ctx):
        if data == bad:
            raise MemoryError()
        return real(self, data, ctx)

    monkeypatch.setattr(Raw, "decode_layer", flaky)
    tier.served.clear()
    result = store.prefix_load(ids, DenseSink()).start().finish()
    assert [c.status for c in result.chunks] == ["loaded", "failed", "skipped", "skipped"]
    assert result.nbytes == tier.served[keys[0]] and result.chunks[1].wasted_bytes == tier.served[keys[1]] > 0
    assert result.nbytes + result.wasted_bytes == sum(tier.served.values())


def test_a_bad_copy_read_before_a_good_one_is_wasted(real_kv):
    """The fast tier's copy of chunk 0 is damaged: read, evicted, and counted as wasted; the slow tier's is used."""
    ids, kv = _real(real_kv, 2 * CHUNK)
    fast, slow = Served("fast"), Served("slow")
    store = KVStore([fast, slow], model=real_kv.model, codec="raw", chunk_tokens=CHUNK,
                    policy=PlacementPolicy(put_tiers=["fast", "slow"], promote_on_hit=False))
    store.put(ids, kv)
    key = store.keys_for(ids)[0][0]
    value = fast.get(key)
    fast.put(key, value[:1000] + bytes([value[1000] ^ 1]) + value[1001:])
    fast.served.clear()
    result = store.prefix_load(ids, DenseSink()).start().finish()
    assert result.complete and not fast.contains(key)
    first = result.chunks[0]
    assert first.tier == "slow" and first.nbytes == slow.served[key] and first.wasted_bytes == fast.served[key] > 0
    assert result.wasted_bytes == first.wasted_bytes


def test_a_load_left_to_recompute_reads_nothing_and_says_why(real_kv):
    store, ids, memory, link = _two_tiers(real_kv)
    store.telemetry.decode_rate = lambda codec: Pinned(1e3)  # both decode 1 k tokens/s: an engine at 1 M/s wins
    result = store.prefix_load(ids, DenseSink(), recompute_tps=1e6).start().finish()
    first = result.chunks[0]
    assert first.status == "recompute" and first.decision.rule == plan.RECOMPUTE and first.decision.variant is None
    assert first.decision.recompute_tps == 1e6 and first.decision.decode_tps == (1e3, 1e3)
    assert result.nbytes == result.wasted_bytes == sum(_served(memory, link).values()) == 0
