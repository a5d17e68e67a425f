"""The LMCache plugins on the CPU, without LMCache: LMCache-layout chunks ``[2, L, T, H*D]`` through
kvcodec codecs, the remote connector (stand-in allocator and keys) and the serializer pair."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from stand_ins import Pinned

import kvcodec
import kvcodec.engines.lmcache_plugin as lp
from kvcodec.cache import KVCache
from kvcodec.codecs import get_codec
from kvcodec.engines.lmcache import serde
from kvcodec.errors import InvalidInputError
from kvcodec.store import KVStore

L, T, H, D = 4, 256, 3, 16


def _chunk(dtype=torch.float16, seed=0, tokens=T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, L, tokens, H * D, generator=g) * 3).to(dtype)


class FakeMemoryObj:
    def __init__(self, tensor):
        self.tensor, self.refs = tensor, 1

    def get_shape(self):
        return self.tensor.shape

    def ref_count_down(self):
        self.refs -= 1


class FakeCPUBackend:
    """LMCache's LocalCPUBackend.allocate(shape, dtype[, fmt]) -> MemoryObj."""

    def allocate(self, shape, dtype, fmt=None):
        return FakeMemoryObj(torch.empty(shape, dtype=dtype))


class Key:
    def __init__(self, s):
        self.s = s

    def to_string(self):
        return self.s


def _run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def _object_key(chunk_hash: bytes = b"a" * 16, model: str = "m", salt: str = "") -> SimpleNamespace:
    """LMCache's ``ObjectKey`` (what its multiprocess server hands the serializer with each object)."""
    return SimpleNamespace(chunk_hash=chunk_hash, model_name=model, kv_rank=0, object_group_id=0, cache_salt=salt)


def _serialized(ser, chunk: torch.Tensor, key) -> torch.Tensor:
    """``chunk`` serialized for ``key`` into an estimate-sized buffer followed, as LMCache loads it, by slack of no
    meaning."""
    layout = SimpleNamespace(shapes=[chunk.shape], dtypes=[chunk.dtype])
    buf = FakeMemoryObj(torch.zeros(ser.estimate_serialized_size(layout), dtype=torch.uint8))
    n = ser.serialize(FakeMemoryObj(chunk), buf, key)
    assert 0 < n <= buf.tensor.numel()
    loaded = torch.randint(0, 256, (buf.tensor.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    loaded[:n] = buf.tensor[:n]
    return loaded


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_serializer_raw_round_trip_bit_exact(dtype):
    ser, de = lp.make_serde({"type": "kvcodec", "codec": "raw", "num_heads": H})
    chunk, key = _chunk(dtype), _object_key()
    out = FakeMemoryObj(torch.empty_like(chunk))
    de.deserialize(FakeMemoryObj(_serialized(ser, chunk, key)), out, key)
    assert out.tensor.dtype == dtype and torch.equal(out.tensor, chunk)


def test_serializer_cachegen_round_trip_real_kv(real_kv):
    """A real SmolLM2 chunk (256 tokens, 30 layers, 3 KV heads of 64) in LMCache's layout through cachegen:
    exactly what cachegen makes of it, compressed."""
    kv = KVCache([(l.keys[:, :256], l.values[:, :256]) for l in real_kv.layers])
    chunk = kv.to_lmcache()
    assert chunk.shape == (2, 30, 256, 3 * 64)
    ser, de = lp.make_serde({"type": "kvcodec", "codec": "cachegen", "num_heads": 3})
    key = _object_key()
    loaded = _serialized(ser, chunk, key)
    assert int(serde.SERIALIZED_LENGTH.unpack(loaded[:8].numpy().tobytes())[0]) < chunk.numel() * 2 / 2.5
    out = FakeMemoryObj(torch.empty_like(chunk))
    de.deserialize(FakeMemoryObj(loaded), out, key)
    direct = kvcodec.decode(kvcodec.encode(kv, get_codec("cachegen"), chunk_tokens=256)).to_lmcache()
    assert torch.equal(out.tensor, direct)
    rel_rms = (out.tensor.float() - chunk.float()).pow(2).mean().sqrt() / chunk.float().pow(2).mean().sqrt()
    assert rel_rms < 0.25  # lossy (the per-element error is what cachegen trades for ~3.5x; quality is measured in bench/)


def test_remote_connector_put_get_exists():
    conn = lp.KVCodecConnectorAdapter().create_connector(SimpleNamespace(
        url="kvcodec://local/?backend=memory&codec=raw", loop=None, local_cpu_backend=FakeCPUBackend(),
        config=SimpleNamespace(extra_config={}), metadata=SimpleNamespace(kv_shape=(L, 2, T, H, D), model_name="m")))
    assert conn.num_heads == H and conn.store.codec.codec_id == "raw"
    chunk = _chunk(torch.bfloat16, seed=3)
    obj = FakeMemoryObj(chunk.clone())
    key = Key("m@1@0@abc@bfloat16")
    assert not _run(conn.exists(key))
    _run(conn.put(key, obj))
    assert obj.refs == 1  # not released here: LMCache's wrapper around every remote connector does that
    assert _run(conn.exists(key)) and conn.exists_sync(key)
    got = _run(conn.get(key))
    assert isinstance(got, FakeMemoryObj) and torch.equal(got.tensor, chunk)
    assert _run(conn.list()) == [conn.key(key)]  # the store's hashed names
    assert conn.batched_contains([key, Key("nope"), key]) == 1  # leading hits, as LMCache's lookup adds them up
    assert conn.batched_contains([key, key]) == 2 and conn.batched_contains([]) == 0
    assert _run(conn.get(Key("nope"))) is None
    assert conn.remove_sync(key) and not conn.exists_sync(key)
    _run(conn.close())


def test_remote_connector_partial_chunk_and_disk(tmp_path):
    conn = lp.connector_from_url(f"kvcodec://{tmp_path}/kv?backend=disk&codec=raw&num_heads={H}",
                                 local_cpu_backend=FakeCPUBackend())
    part = _chunk(torch.float16, seed=4, tokens=100)
    _run(conn.put(Key("k"), FakeMemoryObj(part)))
    got = _run(conn.get(Key("k")))
    assert got.tensor.shape == part.shape
    assert torch.equal(got.tensor, part) and conn.tier.name == "disk"
    assert conn.stats["puts"] == 1 and conn.stats["hits"] == 1


def test_damaged_chunk_is_a_miss_and_deleted():
    conn = lp.connector_from_url(f"kvcodec://local/?backend=memory&codec=raw&num_heads={H}")
    _run(conn.put(Key("k"), FakeMemoryObj(_chunk())))
    tier, k = conn.tier, conn.key(Key("k"))
    blob = bytearray(tier.get(k))
    blob[len(blob) // 2] ^= 0x55
    tier.put(k, bytes(blob))
    assert _run(conn.get(Key("k"))) is None  # not raised: LMCache recomputes the chunk
    assert not conn.exists_sync(Key("k")) and conn.stats["corrupt"] == 1


def test_codec_options_from_url():
    conn = lp.connector_from_url(f"kvcodec://local/?backend=memory&codec=kivi&bits=4&num_heads={H}")
    assert conn.store.codec.codec_id == "kivi" and conn.store.codec.get_config().get("bits") == 4
    with pytest.raises(InvalidInputError):
        lp.connector_from_url("redis://127.0.0.1:6379")
    with pytest.raises(InvalidInputError):
        lp.connector_from_url("kvcodec://local/?backend=tape")


def test_serializer_refuses_a_short_buffer_and_registers_only_with_lmcache():
    ser, de = lp.make_serde({"type": "kvcodec", "codec": "raw", "num_heads": H})
    chunk, key = _chunk(), _object_key()
    loaded = _serialized(ser, chunk, key)
    n = int(serde.SERIALIZED_LENGTH.unpack(loaded[:8].numpy().tobytes())[0])
    with pytest.raises(kvcodec.CorruptDataError):  # a length beyond the buffer
        de.deserialize(FakeMemoryObj(loaded[: n + 7]), FakeMemoryObj(torch.empty_like(chunk)), key)
    assert lp.register() is lp.HAVE_LMCACHE_SERDE
    with pytest.raises(InvalidInputError, match="num_heads"):
        lp.make_serde({"type": "kvcodec", "codec": "raw"})
    with pytest.raises(InvalidInputError, match="tiers"):
        lp.make_serde({"type": "kvcodec", "codec": "raw", "num_heads": H, "tiers": ["cpu"]})
    with pytest.raises(InvalidInputError, match="secret"):
        lp.make_serde({"type": "kvcodec", "codec": "raw", "num_heads": H, "secret": "s" * 32})


def test_adapter_takes_the_plugin_url_of_remote_storage_plugins():
    """remote_storage_plugins: ["kvcodec"] makes LMCache build a backend with URL plugin://kvcodec; the kvcodec:// URL
    comes from extra_config remote_storage_plugin.kvcodec.url."""
    adapter = lp.KVCodecConnectorAdapter()
    assert adapter.can_parse("plugin://kvcodec") and adapter.can_parse("plugin://kvcodec.second")
    assert adapter.can_parse("kvcodec://local/") and not adapter.can_parse("plugin://fs")
    extra = {"remote_storage_plugin.kvcodec.url": f"kvcodec://local/?backend=memory&codec=raw&num_heads={H}"}
    conn = adapter.create_connector(SimpleNamespace(url="plugin://kvcodec", plugin_name="kvcodec", loop=None,
                                                    local_cpu_backend=None, metadata=None,
                                                    config=SimpleNamespace(extra_config=extra)))
    assert conn.store.codec.codec_id == "raw" and conn.tier.name == "cpu"
    with pytest.raises(InvalidInputError, match="remote_storage_plugin.kvcodec.url"):
        adapter.create_connector(SimpleNamespace(url="plugin://kvcodec", plugin_name="kvcodec", loop=None,
                                                 local_cpu_backend=None, metadata=None,
                                                 config=SimpleNamespace(extra_config={})))


def test_regression_torn_chunk_counted_by_batched_contains():
    """LMCache plans a load for every chunk ``batched_contains`` counts: a torn value (a put cut short) was counted
    until a load evicted it, and LMCache then recomputed the chunk it had reserved memory for.  Now the count stops
    before it, and it is evicted there."""
    conn = lp.connector_from_url(f"kvcodec://local/?backend=memory&codec=raw&num_heads={H}")
    keys = [Key("a"), Key("b")]
    for i, key in enumerate(keys):
        _run(conn.put(key, FakeMemoryObj(_chunk(seed=i))))
    tier, torn = conn.tier, conn.key(keys[1])
    tier.put(torn, tier.get(torn)[:-100])
    assert conn.batched_contains(keys) == 1
    assert not tier.contains(torn) and conn.store.stats["corrupt"] == 1
    assert _run(conn.get(keys[0])) is not None


# --- never serve the wrong KV ----------------------------------------------------------------

def _connector(tier_heads: int = H):
    return lp.KVCodecConnectorAdapter().create_connector(SimpleNamespace(
        url=f"kvcodec://local/?backend=memory&codec=raw&num_heads={tier_heads}", loop=None,
        local_cpu_backend=FakeCPUBackend(), config=SimpleNamespace(extra_config={}),
        metadata=SimpleNamespace(kv_shape=(L, 2, T, H, D), kv_dtype=torch.float16, model_name="m")))


def _plant(conn, key: str, chunk: torch.Tensor, heads: int = H, name: str | None = None) -> None:
    """Write ``chunk`` under the tier key of LMCache's ``key`` as a writer that checks nothing would: no engine shape,
    no secret, and written for ``name``'s key (default ``key``'s own)."""
    planted = KVStore(conn.store.tiers, model="m", codec="raw", chunk_tokens=T)
    value_key = conn.key(Key(name or key))
    conn.tier.delete(value_key)  # replace what is there
    planted.put_chunk(value_key, KVCache.from_lmcache(chunk, heads, model="m"))
    if name is not None:
        conn.tier.put(conn.key(Key(key)), conn.tier.get(value_key))


def test_a_chunk_of_another_shape_than_lmcaches_is_a_miss_and_deleted():
    """Same element count, other heads and head size ([2, L, T, 1*48] where LMCache holds 3 heads of 16)."""
    conn = _connector()
    _plant(conn, "k", _chunk(), heads=1)
    assert _run(conn.get(Key("k"))) is None and not conn.exists_sync(Key("k")) and conn.stats["corrupt"] == 1


def test_a_chunk_moved_to_another_key_is_a_miss_and_deleted():
    """A valid chunk of the right shape, copied under another chunk's key, is not served as that chunk."""
    conn = _connector()
    _plant(conn, "b", _chunk(seed=7), name="a")
    assert _run(conn.get(Key("a"))) is not None
    assert _run(conn.get(Key("b"))) is None and not conn.exists_sync(Key("b")) and conn.stats["corrupt"] == 1


def test_a_local_decode_fault_is_a_miss_that_keeps_the_entry(monkeypatch):
    conn = _connector()
    _run(conn.put(Key("k"), FakeMemoryObj(_chunk())))

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(KVStore, "decode_chunk", out_of_memory)
    assert _run(conn.get(Key("k"))) is None and conn.exists_sync(Key("k")) and conn.stats["corrupt"] == 0


def test_deserializer_refuses_a_chunk_of_another_shape_with_the_same_element_count():
    ser, de = lp.make_serde({"type": "kvcodec", "codec": "raw", "num_heads": 4})
    chunk, key = torch.randn(2, 4, 8, 4 * 4).half(), _object_key()  # [2, L=4, T=8, H*D=16]
    loaded = _serialized(ser, chunk, key)
    out = FakeMemoryObj(torch.zeros(2, 8, 4, 16, dtype=torch.float16))  # 8 layers of 4 tokens: same count
    with pytest.raises(kvcodec.CorruptDataError):
        de.deserialize(FakeMemoryObj(loaded), out, key)
    assert not out.tensor.any()


def test_with_a_deployment_secret_values_are_authenticated(monkeypatch):
    from kvcodec.store.auth import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "s" * 32)
    conn = _connector()
    chunk = _chunk()
    _run(conn.put(Key("k"), FakeMemoryObj(chunk)))
    assert torch.equal(_run(conn.get(Key("k"))).tensor, chunk)
    _plant(conn, "k", _chunk(seed=9))  # valid KV, no tag
    assert _run(conn.get(Key("k"))) is None and not conn.exists_sync(Key("k")) and conn.stats["corrupt"] == 1


# --- the serializer binds each value to LMCache's object key (issue 32) -------------------------------

def test_copied_object_does_not_hit_under_another_key():
    """LMCache's multiprocess server hands the serializer each object's key: an object stored under key A and
    copied under key B (any client of a shared L2 can do that) is refused under B, never B's KV."""
    ser, de = lp.make_serde({"type": "kvcodec", "codec": "raw", "num_heads": H})
    a, b = _object_key(b"a" * 16), _object_key(b"b" * 16)
    chunk = _chunk(seed=11)
    stored_a = _serialized(ser, chunk, a)
    out = FakeMemoryObj(torch.zeros_like(chunk))
    for other in (b, _object_key(b"a" * 16, salt="tenant2"), _object_key(b"a" * 16, model="other")):
        with pytest.raises(kvcodec.CorruptDataError):
            de.deserialize(FakeMemoryObj(stored_a.clone()), out, other)
        assert not out.tensor.any()
    de.deserialize(FakeMemoryObj(stored_a), out, a)
    assert torch.equal(out.tensor, chunk)


def test_serialized_value_without_the_secret_is_refused(monkeypatch):
    """With ``$KVCODEC_STORE_SECRET`` set, the serializer seals each value and the deserializer refuses one written
    without the secret (valid KV, bound to the right key)."""
    from kvcodec.store.auth import SECRET_ENV

    chunk, key = _chunk(seed=12), _object_key()
    monkeypatch.delenv(SECRET_ENV, raising=False)
    unsealed = _serialized(lp.make_serde({"type": "kvcodec", "codec": "raw", "num_heads": H})[0], chunk, key)
    monkeypatch.setenv(SECRET_ENV, "s" * 32)
    ser, de = lp.make_serde({"type": "kvcodec", "codec": "raw", "num_heads": H})
    out = FakeMemoryObj(torch.zeros_like(chunk))
    with pytest.raises(kvcodec.CorruptDataError):
        de.deserialize(FakeMemoryObj(unsealed), out, key)
    assert not out.tensor.any()
    de.deserialize(FakeMemoryObj(_serialized(ser, chunk, key)), out, key)
    assert torch.equal(out.tensor, chunk)


# --- one configuration (issue 32) ------------------------------------------------------------------

def test_kvcodec_url_with_a_password_is_refused():
    """Engines log their configuration: a Redis password goes in a file or an environment variable the URL names."""
    for url in ("kvcodec://:hunter2@127.0.0.1:6379/?backend=redis&codec=raw",
                "kvcodec://alice:p%40ss@127.0.0.1:6379/0?backend=rediss&codec=raw"):
        with pytest.raises(InvalidInputError, match="password_file") as err:
            lp.connector_from_url(url)
        assert "hunter2" not in str(err.value) and "p%40ss" not in str(err.value)


def test_url_settings_are_the_store_configuration(tmp_path):
    """The URL's store settings (namespace, chunk size, calibration policy) reach the store; a setting neither the
    store, the tier nor the codec takes is an error."""
    from kvcodec.engines.lmcache.settings import url_config

    config, own = url_config(f"kvcodec://{tmp_path}/kv?backend=disk&capacity=1MiB&codec=kivi&bits=4&num_heads=3"
                             "&namespace=team-a&calibrate=now&calibrate.max_tokens=512&workers=3")
    assert own == {"backend": "disk", "num_heads": "3", "workers": "3"}
    assert config.codec == "kivi" and config.codec_options == {"bits": 4} and config.namespace == "team-a"
    assert config.calibrate == "now" and config.calibration_options == {"max_tokens": 512}
    assert config.tiers == (f"file://{tmp_path}/kv?capacity=1MiB",)
    conn = lp.connector_from_url(f"kvcodec://local/?backend=memory&codec=raw&num_heads={H}&namespace=team-a")
    assert conn.store.identity.namespace == "team-a" and conn.key(Key("k")).startswith(
        conn.store.engine_key("k", b"lmcache-chunk/1\0")[:8])
    with pytest.raises(InvalidInputError, match="nosuch"):
        lp.connector_from_url(f"kvcodec://local/?backend=memory&codec=raw&num_heads={H}&nosuch=1")


def test_remote_connector_loads_each_chunk_in_the_variant_that_restores_soonest(real_kv):
    """``codec`` given twice in the URL: every chunk is stored in cachegen and raw, and LMCache's get reads the one
    the store's estimates say restores soonest (issue 33, item 4), through LMCache's own calls."""
    conn = lp.connector_from_url("kvcodec://local/?backend=memory&codec=cachegen&codec=raw&num_heads=3"
                                 "&telemetry=off", local_cpu_backend=FakeCPUBackend())
    kv = KVCache([(l.keys[:, :256], l.values[:, :256]) for l in real_kv.layers])
    key = Key("m@1@0@real@float16")
    _run(conn.put(key, FakeMemoryObj(kv.to_lmcache())))
    assert [c.codec_id for c in conn.store.variants] == ["cachegen", "raw"] and conn.batched_contains([key]) == 1
    conn.store.telemetry.decode_rate = lambda codec: Pinned(256 / 0.05 if codec.codec_id == "cachegen" else 1e12)
    for bps, chosen in ((1e10, "raw"), (1e6, "cachegen")):
        conn.store.telemetry.link(conn.tier.name).throughput = Pinned(bps)
        got = _run(conn.get(key))
        assert torch.equal(got.tensor, kv.to_lmcache()) == (chosen == "raw")
        assert conn.stats[f"chunk_loads_{chosen}"] == 1
    conn.tier.delete(conn.store.chunk_keys(conn.key(key))[0])  # cachegen gone: raw, on the slow link too
    assert torch.equal(_run(conn.get(key)).tensor, kv.to_lmcache()) and conn.exists_sync(key)
    _run(conn.close())
