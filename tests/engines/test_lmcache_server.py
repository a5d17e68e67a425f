"""kvcodec's serializer inside a real LMCache multiprocess server (``lmcache server``, LMCache 0.5.6), through the
plugin L2 adapters of :mod:`kvcodec.engines.lmcache_server`: LMCache's ``fs`` adapter that loads serialized objects
at their real length, and kvcodec's Mooncake tier against a real ``mooncake_master``.

With ``raw``, each server first takes LMCache's own ``lmcache bench server`` traffic (cold store, warm retrieve, its
checksums; random KV); then LMCache's bench client stores real SmolLM2 KV (two 256-token chunks), the server's L1 is
cleared, and the same request is looked up and retrieved, so the chunks come back from L2 through the
deserializer: bit-exact with ``raw``, and with ``cachegen``/``kvtc`` exactly what that codec makes of each chunk
(its own encode and decode, the codec's error and no other).  One server start per case (8-40 s)."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.store.config import StoreConfig
from kvcodec.store.identity import CacheIdentity, model_identity
from kvcodec.tools.harness import wait_until
from kvcodec.tools.harness.lmcache_server import KVClient, LMCacheServer

L, H, D = 30, 3, 64
TOKENS = 512
BENCH_SHAPE = f"(2,128,16,{H},{D}):float16:{L}"
MODULE = "kvcodec.engines.lmcache_server"
SEQ = 100  # LMCache's bench uses sequences 0 and 1; the real KV goes under another one


@pytest.fixture(scope="module")
def real_kv(real_dump) -> torch.Tensor:
    """512 tokens of SmolLM2's real float16 KV in LMCache's ``[2, L, T, H*D]``."""
    return kvcodec.KVCache.load_safetensors(real_dump("license:GPL-3", 600)).to_lmcache()[:, :, :TOKENS].contiguous()


def _serde(codec: str, **more) -> dict:
    return {"type": "kvcodec", "codec": codec, "num_heads": H, **more}


def _through_l2(server: LMCacheServer, kv: torch.Tensor, stored: callable, *, bench: bool,
                store_s: float = 60) -> torch.Tensor:
    """LMCache's bench traffic (when ``bench``), then ``kv`` stored, L1 cleared once ``stored(n)`` says L2 holds
    ``n`` objects (within ``store_s``), and retrieved: what came back."""
    if bench:
        report = server.bench(BENCH_SHAPE)["results"]
        assert report["total_requests"] == 2 and report["checksum_ok"] == 2 and report["checksum_fail"] == 0, report
    with KVClient(server, layers=L, heads=H, head_dim=D, tokens=TOKENS) as client:
        client.store(SEQ, kv)
        wait_until("the L2 store", lambda: stored(6 if bench else 2), store_s)  # the bench's 2 x 2 chunks and these 2
        server.clear_l1()
        assert client.lookup(SEQ) == TOKENS  # prefetched from L2 into L1
        got, _ = client.retrieve(SEQ)
    return got


def _codec_round_trip(kv: torch.Tensor, codec: str, model: str | None = None) -> torch.Tensor:
    """What ``codec`` itself (as a store for ``model`` resolves it: kvtc's calibration by the model identity) makes
    of each 256-token chunk of ``kv``."""
    identity = CacheIdentity(model_digest=model_identity(model)) if model else None
    own = StoreConfig(codec=codec).store(model=model or "m", identity=identity).codec
    return torch.cat([kvcodec.decode(kvcodec.encode(kvcodec.KVCache.from_lmcache(kv[:, :, s:s + 256], H), own,
                                                    chunk_tokens=256)).to_lmcache()
                      for s in range(0, TOKENS, 256)], 2).to(kv.dtype)


def _fs_adapter(folder: Path, serde: dict) -> dict:
    return {"type": "plugin", "module_path": MODULE, "class_name": "KVCodecFSL2Adapter",
            "adapter_params": {"base_path": str(folder)}, "serde": serde}


def _files(folder: Path) -> list[int]:
    return sorted(p.stat().st_size for p in folder.glob("*.data"))


@pytest.mark.parametrize("codec", ["raw", "cachegen"])
def test_fs_adapter(codec, real_kv, tmp_path):
    folder = tmp_path / "l2"
    folder.mkdir()
    with LMCacheServer(tmp_path, _fs_adapter(folder, _serde(codec))) as server:
        got = _through_l2(server, real_kv, lambda n: len(_files(folder)) >= n, bench=codec == "raw")
        sizes = _files(folder)
        if codec == "raw":
            assert torch.equal(got, real_kv)
            chunk_bytes = real_kv[:, :, :256].numel() * 2
            assert all(chunk_bytes < n < chunk_bytes + 4096 for n in sizes), sizes  # raw bytes plus the container
        else:
            assert torch.equal(got, _codec_round_trip(real_kv, codec))
            assert 0 < float((got.float() - real_kv.float()).abs().max())  # lossy: it went through cachegen
            assert max(sizes) < real_kv[:, :, :256].numel() * 2 / 4, sizes  # stored compressed, not padded
        # a damaged object is a miss, never wrong KV: truncate every stored chunk, then ask again
        for path in folder.glob("*.data"):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        server.clear_l1()
        with KVClient(server, layers=L, heads=H, head_dim=D, tokens=TOKENS) as client:
            assert client.lookup(SEQ, timeout_s=3) == 0
        assert server.proc.poll() is None


def test_fs_adapter_kvtc_calibrated_in_the_server(real_kv, smollm2_hf, tmp_path, monkeypatch):
    """``codec: kvtc`` with the served model, ``calibrate: now`` and no calibration installed: the server calibrates
    it when the serializer first meets the model (a small calibration keeps this short), and the chunks come back
    as kvtc makes them."""
    from kvcodec.codecs.kvtc import calibration as calmod

    xdg, folder, model = tmp_path / "xdg", tmp_path / "l2", str(smollm2_hf)
    folder.mkdir()
    serde = _serde("kvtc", model=model, calibrate="now",
                   calibration_options={"max_tokens": 256, "segment_tokens": 128, "group_layers": 1})
    with LMCacheServer(tmp_path, _fs_adapter(folder, serde), env={"XDG_CACHE_HOME": str(xdg)}) as server:
        got = _through_l2(server, real_kv, lambda n: len(_files(folder)) >= n, bench=False, store_s=300)
    assert list((xdg / "kvcodec" / "calibrations").glob("*.kvtc")), "the server installed no calibration"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))  # this process finds the server's calibration
    monkeypatch.setattr(calmod, "_registered", {})
    assert torch.equal(got, _codec_round_trip(real_kv, "kvtc", model))
    assert 0 < float((got.float() - real_kv.float()).abs().max())


@pytest.mark.parametrize("codec", ["raw", "cachegen"])
def test_mooncake_tier_adapter(codec, real_kv, tmp_path, mooncake_master):
    master = mooncake_master
    url = f"mooncake://{master.address}?segment=256MiB&buffer=64MiB&admin={master.admin}"
    adapter = {"type": "plugin", "module_path": MODULE, "class_name": "KVCodecTierL2Adapter",
               "adapter_params": {"url": url}, "serde": _serde(codec)}

    def keys() -> list[str]:
        with urllib.request.urlopen(f"http://{master.admin}/get_all_keys", timeout=5) as r:
            return [k for k in r.read().decode().split() if k.startswith("kvcodec:lmcache@")]

    with LMCacheServer(tmp_path, adapter) as server:
        got = _through_l2(server, real_kv, lambda n: len(keys()) >= n, bench=codec == "raw")
    expected = real_kv if codec == "raw" else _codec_round_trip(real_kv, codec)
    assert torch.equal(got, expected)


def _swapped_objects_miss(server: LMCacheServer, swap: callable) -> None:
    """Store the real KV's two chunks, ``swap()`` their stored values (a writer of the shared L2 moving an object
    under another key), clear L1: neither comes back (before, each was a clean hit holding the other's KV)."""
    with KVClient(server, layers=L, heads=H, head_dim=D, tokens=TOKENS) as client:
        client.store(SEQ, server.real_kv)
    swap()
    server.clear_l1()
    with KVClient(server, layers=L, heads=H, head_dim=D, tokens=TOKENS) as client:
        assert client.lookup(SEQ, timeout_s=3) == 0
    assert server.proc.poll() is None


def _swap(values: dict[str, bytes], put: callable) -> None:
    assert len(values) == 2, sorted(values)
    (a, va), (b, vb) = values.items()
    assert va != vb
    put(a, vb)
    put(b, va)


def test_copied_object_does_not_hit_under_another_key_fs(real_kv, tmp_path):
    folder = tmp_path / "l2"
    folder.mkdir()
    with LMCacheServer(tmp_path, _fs_adapter(folder, _serde("raw"))) as server:
        server.real_kv = real_kv

        def swap() -> None:
            wait_until("the L2 store", lambda: len(_files(folder)) >= 2)
            _swap({str(p): p.read_bytes() for p in folder.glob("*.data")}, lambda p, v: Path(p).write_bytes(v))

        _swapped_objects_miss(server, swap)


def test_copied_object_does_not_hit_under_another_key_mooncake(real_kv, tmp_path, mooncake_master):
    from kvcodec.store.tiers import tier_from_url

    master = mooncake_master
    url = f"mooncake://{master.address}?segment=256MiB&buffer=64MiB&admin={master.admin}"
    adapter = {"type": "plugin", "module_path": MODULE, "class_name": "KVCodecTierL2Adapter",
               "adapter_params": {"url": url}, "serde": _serde("raw")}
    writer = tier_from_url(url)  # another client of the same master
    try:
        with LMCacheServer(tmp_path, adapter) as server:
            server.real_kv = real_kv

            def swap() -> None:
                wait_until("the L2 store", lambda: len(writer.keys()) >= 2)
                _swap({k: writer.get(k) for k in writer.keys()}, writer.put)

            _swapped_objects_miss(server, swap)
    finally:
        writer.close()


def test_store_completion_after_a_pop_is_not_lost():
    """LMCache pops the completed store tasks while others still run; a store finishing after that pop must be
    reported by the next one (else LMCache never releases that object's L1 read locks)."""
    from types import SimpleNamespace

    from lmcache.v1.distributed.api import ObjectKey

    from kvcodec.engines.lmcache_server import KVCodecTierL2Adapter

    adapter = KVCodecTierL2Adapter({"url": "memory://"})
    entered, release = threading.Event(), threading.Event()
    put = adapter.tier.put

    def held_put(key: str, value: bytes) -> bool:
        entered.set()
        assert release.wait(10)
        return put(key, value)

    adapter.tier.put = held_put
    try:
        key = ObjectKey(chunk_hash=b"\1" * 16, model_name="m", kv_rank=0)
        task = adapter.submit_store_task([key], [SimpleNamespace(byte_array=bytearray(b"serialized"))])
        assert entered.wait(10)
        assert adapter.pop_completed_store_tasks() == {}  # LMCache polls while the store runs
        release.set()
        done: dict = {}
        wait_until("the store's completion", lambda: done.update(adapter.pop_completed_store_tasks()) or task in done,
                    timeout_s=10)
        assert done[task] == len(b"serialized")  # L2StoreResult: success, bytes stored
    finally:
        release.set()
        adapter.close()


@pytest.mark.parametrize("params, why", [({}, "needs adapter_params"), ({"url": "memory://", "workers": 0}, "workers"),
                                         ({"url": "memory://", "path": "/x"}, "unknown adapter_params"),
                                         ({"url": "nosuch://x"}, "unknown scheme")])
def test_tier_adapter_refuses_bad_params(params, why):
    from kvcodec.engines.lmcache_server import KVCodecTierL2Adapter
    from kvcodec.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=why):
        KVCodecTierL2Adapter(params)


def _adapter_status(server: LMCacheServer, adapter_type: str) -> dict:
    """The server's ``GET /status`` report of its L2 adapter of ``adapter_type``."""
    import json

    def find(node):
        if isinstance(node, dict):
            if node.get("type") == adapter_type:
                return node
            node = list(node.values())
        for child in node if isinstance(node, list) else []:
            if (hit := find(child)) is not None:
                return hit
        return None

    with urllib.request.urlopen(f"{server.http_url}/status", timeout=10) as r:
        status = find(json.loads(r.read()))
    assert status is not None, f"no {adapter_type} in the server's status"
    return status


def test_truncated_fs_object_is_evicted_not_reread_with_a_traceback_per_lookup(real_kv, tmp_path):
    """Issue 35, item 9: a truncated object in the fs adapter's folder stayed there, so every lookup loaded it again
    and LMCache logged the deserializer's ERROR traceback each time (58 per server in one run).  Now the first load
    evicts it (one warning), later lookups are clean misses for it, and the intact chunk beside it still loads (the
    deserializer's failure used to fail the whole load task)."""
    folder = tmp_path / "l2"
    folder.mkdir()
    with LMCacheServer(tmp_path, _fs_adapter(folder, _serde("raw"))) as server:
        with KVClient(server, layers=L, heads=H, head_dim=D, tokens=256) as client:  # the first chunk alone
            client.store(SEQ, real_kv[:, :, :256].contiguous())
        wait_until("the first chunk's L2 store", lambda: len(_files(folder)) >= 1)
        (first,) = folder.glob("*.data")
        with KVClient(server, layers=L, heads=H, head_dim=D, tokens=TOKENS) as client:  # and the second after it
            client.store(SEQ, real_kv)
        wait_until("the second chunk's L2 store", lambda: len(_files(folder)) >= 2)
        time.sleep(0.5)  # the last file was renamed into place; let its store task report
        (torn,) = set(folder.glob("*.data")) - {first}
        logged = len(server.log.read_bytes())
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
        hits = []
        for _ in range(3):
            server.clear_l1()
            with KVClient(server, layers=L, heads=H, head_dim=D, tokens=TOKENS) as client:
                hits.append(client.lookup(SEQ, timeout_s=3))
            assert not torn.exists(), "the truncated object is still in the folder after a lookup"
        assert server.proc.poll() is None
        assert _adapter_status(server, "KVCodecFSL2Adapter")["evicted"] == 1
    log = server.log.read_bytes()[logged:].decode(errors="replace")
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert sum(f"{torn.name} is bad" in line for line in log.splitlines()) == 1, log[-3000:]
    assert first.exists() and hits == [256] * 3, hits  # the intact first chunk is still served


@pytest.mark.parametrize("adapter_class", ["KVCodecFSL2Adapter", "KVCodecTierL2Adapter"])
def test_torn_object_is_evicted_by_its_first_load_and_an_intact_one_loads(adapter_class, tmp_path):
    """Both adapters, driven as LMCache's serde wrapper drives them (a load into a serde buffer sized by the
    serializer's estimate): an object shorter than the length it starts with is evicted by its first load, once,
    and counted; an intact object of the same key loads at its own length."""
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    from kvcodec.engines.lmcache.serde import SERIALIZED_LENGTH, object_key_name
    from kvcodec.engines.lmcache_server import KVCodecFSL2Adapter, KVCodecFSL2AdapterConfig, KVCodecTierL2Adapter

    key = ObjectKey(chunk_hash=b"\2" * 16, model_name="m", kv_rank=0)
    value = bytes(range(256)) * 8
    stored = SERIALIZED_LENGTH.pack(len(value)) + value
    if adapter_class == "KVCodecFSL2Adapter":
        adapter = KVCodecFSL2Adapter(KVCodecFSL2AdapterConfig(base_path=str(tmp_path)))
        path = adapter._key_to_path(key)
        put, held = path.write_bytes, path.exists
    else:
        adapter = KVCodecTierL2Adapter({"url": "memory://"})
        name = object_key_name(key)
        put, held = (lambda data: adapter.tier.put(name, data)), (lambda: adapter.tier.contains(name))
    def load() -> tuple[bool, object]:
        size = torch.Size([len(stored) + 4096])  # the serializer's estimate: an upper bound
        buffer = TensorMemoryObj(torch.zeros(size, dtype=torch.uint8), MemoryObjMetadata(
            shape=size, dtype=torch.uint8, address=0, phy_size=size.numel(), ref_count=1, shapes=[size],
            dtypes=[torch.uint8]), parent_allocator=None)
        task = adapter.submit_load_task([key], [buffer])
        got: list = []
        wait_until("the load", lambda: got.append(adapter.query_load_result(task)) or got[-1] is not None, 10)
        return got[-1].test(0), buffer

    try:
        put(stored[: len(stored) // 2])
        assert load()[0] is False and not held() and adapter.report_status()["evicted"] == 1
        assert load()[0] is False and adapter.report_status()["evicted"] == 1  # gone: a plain miss
        put(stored)
        loaded, buffer = load()
        assert loaded and bytes(buffer.byte_array) == stored and adapter.report_status()["evicted"] == 1
    finally:
        adapter.close()
