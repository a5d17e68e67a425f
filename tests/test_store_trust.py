"""Never serve the wrong KV: what a store key covers, what a stored value must prove before it is served, and
which failures evict a shared entry."""

from __future__ import annotations

import json
import os

import pytest
import torch

import kvcodec
import kvcodec.store.load as load_module
from kvcodec.errors import InvalidInputError
from kvcodec.store import CacheIdentity, ChunkShape, KVStore, MemoryTier
from kvcodec.store.auth import SECRET_ENV

MODEL = "SmolLM2-135M-Instruct"
SECRET = b"0123456789abcdef0123456789abcdef"


def _kv(tokens: int, heads: int = 2, layers: int = 2, seed: int = 0, dim: int = 8) -> kvcodec.KVCache:
    g = torch.Generator().manual_seed(seed)
    return kvcodec.KVCache([(torch.randn(heads, tokens, dim, generator=g).half(),
                             torch.randn(heads, tokens, dim, generator=g).half()) for _ in range(layers)], model=MODEL)


def _store(tier: MemoryTier, **options) -> KVStore:
    options = {"model": MODEL, "codec": "raw", "chunk_tokens": 4} | options
    return KVStore([tier], **options)


IDS = list(range(100, 112))


@pytest.mark.parametrize("differs", [
    {"identity": CacheIdentity(model_digest="other-weights")},
    {"identity": CacheIdentity(kv_dtype="float8_e4m3fn")},
    {"identity": CacheIdentity(tp_rank=1, tp_size=2)},
    {"identity": CacheIdentity(tp_rank=0, tp_size=2)},
    {"identity": CacheIdentity(pp_rank=1, pp_size=2)},
    {"identity": CacheIdentity(namespace="tenant-b")},
    {"secret": SECRET},
    {"codec": "kivi"},
    {"model": "another-model"},
])
def test_a_differing_configuration_never_hits_anothers_chunks(differs):
    tier = MemoryTier(None)
    base = _store(tier)
    assert base.put(IDS, _kv(len(IDS))) == 3
    other = _store(tier, **differs)
    assert other.lookup(IDS).num_tokens == 0 and other.get(IDS) is None
    assert base.lookup(IDS).num_tokens == len(IDS)


def test_a_request_salt_keeps_its_chunks_apart():
    store = _store(MemoryTier(None))
    store.put(IDS, _kv(len(IDS)), salt="user-a")
    assert store.lookup(IDS, salt="user-a").num_tokens == len(IDS)
    assert store.lookup(IDS).num_tokens == 0 and store.lookup(IDS, salt="user-b").num_tokens == 0


def test_namespace_leads_the_key_so_a_tier_can_be_listed_per_tenant():
    store = _store(MemoryTier(None), identity=CacheIdentity(namespace="tenant-a"))
    assert all(k.startswith(f"kvc@tenant-a@{MODEL}@") for k, _, _ in store.keys_for(IDS))


def test_identity_rejects_impossible_ranks():
    with pytest.raises(InvalidInputError, match="tp_rank"):
        CacheIdentity(tp_rank=2, tp_size=2)


def test_a_chunk_written_under_another_configuration_is_refused_and_evicted():
    """The same tokens in the same model under another codec setting: a valid container, but not this key's."""
    tier = MemoryTier(None)
    mine, theirs = _store(tier), _store(tier, codec="kivi")
    kv = _kv(len(IDS))
    theirs.put(IDS, kv)
    key = mine.keys_for(IDS)[0][0]
    tier.put(key, tier.get(theirs.keys_for(IDS)[0][0]))  # their first chunk under my first key
    assert mine.get(IDS) is None
    assert not tier.contains(key) and mine.stats["corrupt"] == 1


def test_stored_values_carry_their_key_not_the_token_ids():
    tier = MemoryTier(None)
    store = _store(tier)
    ids = [31337, 27182, 16180, 14142] * 3
    store.put(ids, _kv(len(ids)))
    for key, _, _ in store.keys_for(ids):
        value = tier.get(key)
        assert b"31337" not in value and b"token_ids" not in value
        with kvcodec.open(value) as r:
            assert r.info.meta["store_key"] == key and "token_ids" not in r.info.meta
    assert store.get(ids).token_ids == ids  # the caller's ids, put back on the way out


# --- authentication -------------------------------------------------------------------------------

def test_secret_round_trip_and_unguessable_keys():
    tier = MemoryTier(None)
    store = _store(tier, secret=SECRET)
    kv = _kv(len(IDS))
    store.put(IDS, kv)
    assert store.get(IDS).equal(kv)
    plain = _store(MemoryTier(None))
    assert {k for k, _, _ in store.keys_for(IDS)}.isdisjoint(k for k, _, _ in plain.keys_for(IDS))


def test_a_forged_value_is_refused_before_decoding_and_evicted(monkeypatch):
    """Someone who can write the tier but lacks the secret stores valid KV of their choosing under a real key."""
    tier = MemoryTier(None)
    store = _store(tier, secret=SECRET)
    store.put(IDS, _kv(len(IDS)))
    key = store.keys_for(IDS)[0][0]
    forged = kvcodec.encode(kvcodec.KVCache([(l.keys[:, :4], l.values[:, :4]) for l in _kv(4, seed=9).layers],
                                            model=MODEL), "raw", chunk_tokens=4, meta={"store_key": key})
    decoded = []
    monkeypatch.setattr(load_module, "decode_chunk_into", lambda *a, **k: decoded.append(1))
    for value in (forged, forged + b"\0" * 32, tier.get(store.keys_for(IDS)[1][0])):  # last: a real value, moved
        tier.put(key, value)
        assert store.get(IDS) is None and not tier.contains(key)
    assert not decoded and store.stats["corrupt"] == 3


def test_a_short_secret_and_an_unkeyed_hash_are_refused():
    with pytest.raises(InvalidInputError, match="16 bytes"):
        _store(MemoryTier(None), secret=b"short")
    with pytest.raises(InvalidInputError, match="HMAC"):
        _store(MemoryTier(None), secret=SECRET, hash="xxh3-128")


# --- bounded, checked loads -----------------------------------------------------------------------

def test_a_small_value_declaring_a_huge_cache_is_refused_without_decoding():
    """A few KB of zstd can declare megabytes (or gigabytes) of KV: the decode is bounded before it allocates."""
    tier = MemoryTier(None)
    store = _store(tier, codec="zstd", chunk_tokens=64, max_chunk_bytes=1 << 20)
    zeros = kvcodec.KVCache([(torch.zeros(4, 64, 1024), torch.zeros(4, 64, 1024)) for _ in range(2)], model=MODEL)
    big = _store(tier, codec="zstd", chunk_tokens=64)  # same key: same model, codec and chunk size
    big.put(list(range(64)), zeros)
    value = tier.get(store.keys_for(list(range(64)))[0][0])
    assert len(value) < 64 << 10 and zeros.nbytes >= 4 * store.max_chunk_bytes
    assert store.get(list(range(64))) is None and len(tier.keys()) == 0


def test_a_chunk_of_another_shape_than_the_engine_holds_is_refused_and_evicted():
    tier = MemoryTier(None)
    writer = _store(tier)
    writer.put(IDS, _kv(len(IDS), heads=1))  # one KV head, where the engine has two
    engine = _store(tier, shape=ChunkShape(layers=2, heads=2, key_dim=8, value_dim=8, dtype="float16"))
    assert engine.get(IDS) is None and not tier.contains(engine.keys_for(IDS)[0][0])  # the prefix ends at the first
    with pytest.raises(InvalidInputError, match="shape"):
        engine.put(IDS, _kv(len(IDS), heads=1))


def test_chunks_that_disagree_in_shape_end_the_prefix_and_the_odd_one_is_evicted():
    tier, odd = MemoryTier(None), MemoryTier(None)
    _store(tier).put(IDS, _kv(len(IDS)))
    _store(odd).put(IDS, _kv(len(IDS), heads=1))
    store = _store(tier)
    second = store.keys_for(IDS)[1][0]
    tier.put(second, odd.get(second))
    for _ in range(2):  # not an error raised on every call: the odd chunk is gone after the first
        assert store.get(IDS).num_tokens == 4
    assert not tier.contains(second)


def test_a_local_fault_is_a_miss_that_leaves_the_shared_entry(monkeypatch):
    tier = MemoryTier(None)
    store = _store(tier)
    store.put(IDS, _kv(len(IDS)))

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(load_module, "decode_chunk_into", out_of_memory)
    assert store.get(IDS) is None
    assert len(tier.keys()) == 3 and store.stats["corrupt"] == 0


# --- engine configuration -------------------------------------------------------------------------

def test_engine_store_takes_its_secret_from_the_environment_not_the_config(monkeypatch, tmp_path):
    from kvcodec.engines.vllm_connector.setup import connector_store

    extra = {"codec": "raw", "tiers": ["cpu"]}
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert connector_store(extra, "m", CacheIdentity()).secret is None
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    assert connector_store(extra, "m", CacheIdentity()).secret == SECRET
    (tmp_path / "secret").write_bytes(b"f" * 40 + b"\n")
    assert connector_store(extra | {"secret_file": str(tmp_path / "secret")}, "m", CacheIdentity()).secret == b"f" * 40
    with pytest.raises(InvalidInputError, match=SECRET_ENV):
        connector_store(extra | {"secret": "in-the-logged-config"}, "m", CacheIdentity())


def test_engine_identity_hashes_the_served_folders_config(tmp_path):
    from kvcodec.engines.vllm_connector.setup import cache_identity

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    a = cache_identity(str(tmp_path), kv_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 31}))
    b = cache_identity(str(tmp_path), kv_dtype="bfloat16")
    assert a.model_digest and a.model_digest != b.model_digest and a.kv_dtype == "bfloat16"


# --- values a read must not pay for (issue 32) ----------------------------------------------------------------------

def _shaped_store(tier, **options):
    """A store of 1 MiB chunks: 2 layers x 2 heads x 1024 tokens x (64 + 64) channels of float16."""
    return KVStore([tier], model="m", codec="raw", chunk_tokens=1024, shape=ChunkShape(2, 2, 64, 64, "float16"),
                   **options)


def _sent_bytes(client) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_redis_reads_no_more_than_a_chunk_of_the_stores_shape(redis_server):
    """A 64 MiB value under a 1 MiB chunk's key costs a load about 1 MiB of transfer, not 64 (the tier's 1 GiB
    max_value was the only bound), and is evicted: it can never be served."""
    import redis

    from kvcodec.store import RedisTier

    tier = RedisTier(port=redis_server.port, timeout_s=5.0)
    store = _shaped_store(tier)
    ids = list(range(1024))
    key = store.keys_for(ids)[0][0]
    assert tier.put(key, b"\0" * (64 << 20))
    client = redis.Redis(port=redis_server.port)
    before = _sent_bytes(client)
    assert store.get(ids) is None
    assert _sent_bytes(client) - before < 4 << 20
    assert not tier.contains(key) and store.stats["corrupt"] == 1


def test_a_redis_value_disagreeing_with_its_metadata_is_evicted(redis_server):
    """Junk under a chunk's key whose ``:meta`` does not match it was a miss left stored, paid for by every load."""
    import redis

    from kvcodec.store import RedisTier

    tier = RedisTier(port=redis_server.port, timeout_s=5.0)
    store = _shaped_store(tier)
    ids = list(range(1024))
    key = store.keys_for(ids)[0][0]
    assert tier.put(key, b"x" * 1000)
    redis.Redis(port=redis_server.port).set(f"kvcodec:{key}:data", b"\0" * (256 << 10))
    assert store.get(ids) is None
    assert not tier.contains(key) and store.stats["corrupt"] == 1


def test_a_value_over_its_bound_in_a_slow_tier_is_evicted_by_a_size_query(tmp_path):
    """A load that plans from value sizes drops a value no chunk of the store's shape can fill, unread."""
    from kvcodec.store import DiskTier

    disk = DiskTier(tmp_path / "kv")
    store = _shaped_store(disk)
    ids = list(range(1024))
    key = store.keys_for(ids)[0][0]
    with open(os.path.join(disk.path, disk._file(key)), "wb") as f:
        f.truncate(1 << 40)  # a sparse terabyte
    assert store.source.value_sizes([key]) == [None]
    assert not disk.contains(key) and store.stats["corrupt"] == 1


def test_damaged_side_data_is_evicted_and_repaired_on_the_next_put(tmp_path, monkeypatch):
    """kvtc's calibration stored beside the chunks: a damaged copy was refused on every load but never evicted, and
    a machine holding a good copy trusted ``contains`` and never wrote it back."""
    from kvcodec.codecs.kvtc import KVTC, register_calibration
    from kvcodec.codecs.kvtc import calibration as calmod
    from kvcodec.tools.fuzz.seeds import fuzz_calibration

    kv = kvcodec.KVCache([(l.keys, l.values) for l in _kv(64).layers], model="m", rope="post")
    cal = register_calibration(fuzz_calibration(kv))
    tier = MemoryTier(None)
    store = KVStore([tier], model="m", codec="kvtc", codec_options={"calibration": cal.digest}, chunk_tokens=32)
    store.put(list(range(64)), kv)
    name = store.codec.side_data_name()
    good = tier.get(name)
    assert good == store.codec.side_data()
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 1
    tier.put(name, bytes(damaged))
    with monkeypatch.context() as new_machine:  # no calibration here: the damaged copy is evicted, not kept
        new_machine.setattr(calmod, "_registered", {})
        new_machine.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        new_machine.delenv(calmod.ENV_PATH, raising=False)
        fresh = KVTC(calibration=cal.digest)
        assert not fresh.has_side_data()
        store.source.fetch_side_data([fresh])
        assert not tier.contains(name) and not fresh.has_side_data()
    store.put(list(range(100, 164)), kv)  # a machine that has it writes it back on its next put
    assert tier.get(name) == good
    tier.put(name, bytes(damaged))  # ... also over a damaged copy where contains() says it is there
    other = KVStore([tier], model="m", codec="kvtc", codec_options={"calibration": cal.digest}, chunk_tokens=32)
    other.put(list(range(200, 264)), kv)
    assert tier.get(name) == good
