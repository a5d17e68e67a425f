"""kvcodec's LMCache plugins inside the real LMCache (0.5.6): a real ``LMCacheEngine`` on the CPU with the remote
storage plugin configured as docs/engines.md says, and the serializer through LMCache's own ``AsyncSerdeProcessor``.
The KV is real: SmolLM2's cache over a license text (``real_dump``), in LMCache's ``[2, L, T, H*D]`` layout."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import kvcodec
from kvcodec.tools.harness.lmcache_engine import CPUEngine, kvcodec_plugin_config
from kvcodec.tools.redis_server import started_redis

L, H, D = 30, 3, 64


@pytest.fixture(scope="module")
def real_chunks(real_dump) -> tuple[list[int], torch.Tensor]:
    """600 tokens of real SmolLM2 KV (two whole 256-token chunks and a partial one) and their token ids."""
    kv = kvcodec.KVCache.load_safetensors(real_dump("license:GPL-3", 600))
    return list(kv.token_ids), kv.to_lmcache()


@pytest.fixture()
def redis(tmp_path):
    server = started_redis(tmp_path)
    yield server
    server.stop()


def _engine(url: str, model: str | None = None, **more) -> CPUEngine:
    return CPUEngine(kvcodec_plugin_config(url, **more), layers=L, heads=H, head_dim=D, dtype=torch.float16,
                     **({"model": model} if model else {}))


def _wait_for_puts(engine: CPUEngine, n: int, timeout_s: float = 60) -> None:
    """LMCache sends chunks to remote backends asynchronously; wait until ``n`` reached the plugin."""
    conn = engine.remote_connector()
    deadline = time.monotonic() + timeout_s
    while conn.stats["puts"] < n:
        assert time.monotonic() < deadline, f"only {conn.stats['puts']} of {n} chunks stored: {conn.stats}"
        time.sleep(0.05)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_store_destroy_and_a_new_engine_retrieves_bit_exactly(tier, real_chunks, tmp_path, request):
    tokens, kv = real_chunks
    tokens, kv = tokens[:512], kv[:, :, :512]
    url = (f"kvcodec://{tmp_path}/kv?backend=disk&codec=raw" if tier == "disk"
           else f"{request.getfixturevalue('redis').url.replace('redis', 'kvcodec')}/?backend=redis&codec=raw")
    with _engine(url) as first:
        first.store(tokens, kv)
        _wait_for_puts(first, 2)
        conn = first.remote_connector()
        assert conn.tier.name == tier
        # raw: every byte, plus headers.  Polled: the store counts a put before put_chunk returns its bytes to the
        # plugin, and a read as soon as "puts" said 2 once saw one chunk's bytes
        deadline = time.monotonic() + 10
        while conn.stats["bytes_out"] <= kv.numel() * 2:
            assert time.monotonic() < deadline, conn.stats
            time.sleep(0.01)
    with _engine(url) as second:  # shares nothing with the first but the storage
        assert second.lookup(tokens) == 512
        got, n = second.retrieve(tokens, kv)
        assert n == 512 and torch.equal(got, kv)
        assert second.remote_connector().stats["hits"] == 2


def test_partial_last_chunk(real_chunks, tmp_path):
    tokens, kv = real_chunks  # 600 tokens: 256 + 256 + 88
    url = f"kvcodec://{tmp_path}/kv?backend=disk&codec=raw"
    with _engine(url, save_unfull_chunk=True) as first:
        first.store(tokens, kv)
        _wait_for_puts(first, 3)
    with _engine(url, save_unfull_chunk=True) as second:
        assert second.lookup(tokens) == 600
        got, n = second.retrieve(tokens, kv)
        assert n == 600 and torch.equal(got, kv)


def test_put_leaves_reference_counts_to_lmcache(real_chunks, tmp_path):
    """LMCache's wrapper around a remote connector releases the memory object after ``put``; the plugin must not
    release it again (a "Double free" that invalidates the caller's object)."""
    tokens, kv = real_chunks
    with _engine(f"kvcodec://{tmp_path}/kv?backend=disk&codec=raw") as engine:
        backend = engine.engine.storage_manager.storage_backends["LocalCPUBackend"]
        obj = backend.allocate(kv[:, :, :256].shape, kv.dtype)
        obj.tensor.copy_(kv[:, :, :256])
        before = obj.get_ref_count()
        conn = engine.remote_connector()
        key = "SmolLM2-135M-Instruct@1@0@refcount@float16"
        asyncio.run(conn.put(key, obj))
        assert obj.get_ref_count() == before
        assert torch.equal(obj.tensor, kv[:, :, :256])  # still the caller's, still valid
        obj.ref_count_down()


def test_redis_down_lookups_miss_without_exceptions(real_chunks, redis):
    tokens, kv = real_chunks
    tokens, kv = tokens[:512], kv[:, :, :512]
    url = redis.url.replace("redis", "kvcodec") + "/?backend=redis&codec=raw&timeout=0.3"
    with _engine(url) as first:
        first.store(tokens, kv)
        _wait_for_puts(first, 2)
    redis.kill()
    with _engine(url) as second:
        start = time.monotonic()
        assert second.lookup(tokens) == 0
        got, n = second.retrieve(tokens, kv)
        assert n == 0 and torch.isnan(got).all()
        second.store(tokens, kv)  # writes fail quietly too
        assert time.monotonic() - start < 30


def test_blocking_work_stays_off_lmcaches_event_loop(real_chunks, redis):
    """A frozen Redis holds a get for its whole socket timeout; LMCache's event loop keeps running meanwhile."""
    tokens, kv = real_chunks
    url = redis.url.replace("redis", "kvcodec") + "/?backend=redis&codec=raw&timeout=2"
    with _engine(url) as engine:
        conn, loop = engine.remote_connector(), engine.remote_connector().loop
        assert loop is not None and loop.is_running()
        redis.pause()
        try:
            slow = asyncio.run_coroutine_threadsafe(conn.get("SmolLM2-135M-Instruct@1@0@frozen@float16"), loop)
            time.sleep(0.2)
            start = time.monotonic()
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)
            assert time.monotonic() - start < 0.5  # not stuck behind the frozen get
            assert slow.result(timeout=30) is None  # the get itself times out into a miss
        finally:
            redis.resume()


def test_serializer_through_lmcaches_async_serde_processor(real_chunks):
    """Serialize into a buffer of ``estimate_serialized_size`` bytes, then deserialize from another buffer of that
    size holding the stored bytes and slack, as LMCache's L2 adapters do."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde import create_serde_processor
    from lmcache.v1.distributed.serde.base import SerdeConfig

    import kvcodec.engines.lmcache_plugin as lp

    tokens, kv = real_chunks
    chunk = kv[:, :, :256].contiguous()
    assert lp.register()
    proc = create_serde_processor(SerdeConfig("kvcodec", {"codec": "raw", "num_heads": H, "max_workers": 2}))
    try:
        assert proc._pool._max_workers == 2  # make_serde passes max_workers on
        size = proc.estimate_serialized_size(MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype]))
        src, dst = _Obj(chunk.clone()), _Obj(torch.zeros(size, dtype=torch.uint8))
        key = ObjectKey(chunk_hash=b"\1" * 16, model_name="SmolLM2-135M-Instruct", kv_rank=0)
        _wait(proc.query_serialize_result, proc.submit_serialize([src], [dst], [key]))
        n = dst.used
        assert 0 < n <= size
        loaded = torch.randint(0, 256, (size,), dtype=torch.uint8)  # a fresh estimate-sized buffer: slack follows
        loaded[:n] = dst.tensor[:n]
        out = _Obj(torch.full_like(chunk, float("nan")))
        _wait(proc.query_deserialize_result, proc.submit_deserialize([_Obj(loaded)], [out], [key]))
        assert torch.equal(out.tensor, chunk)
    finally:
        proc.close()


class _Obj:
    """What the serde processor reads of a memory object: ``tensor``, and ``set_used_size`` on the output."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.used = tensor, None

    def set_used_size(self, n: int) -> None:
        self.used = n


def _wait(query, task_id, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (ok := query(task_id)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ok is True


def test_kvtc_calibrates_the_served_model_on_first_use(real_chunks, smollm2_hf, tmp_path, monkeypatch, caplog):
    """codec=kvtc with no calibration installed for LMCache's model_name (the served folder): the first engine
    calibrates it (logged; a small calibration keeps this short), stores kvtc chunks (joint sections); a new
    engine finds the installed calibration and retrieves exactly what kvtc makes of the KV."""
    from kvcodec.codecs.kvtc import calibration as calmod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(calmod.ENV_PATH, raising=False)
    monkeypatch.setattr(calmod, "_registered", {})
    caplog.set_level("INFO", logger="kvcodec")
    tokens, kv = real_chunks
    tokens, kv = tokens[:512], kv[:, :, :512]
    model = str(smollm2_hf)
    url = (f"kvcodec://{tmp_path}/kv?backend=disk&codec=kvtc&calibrate=now"
           "&calibrate.max_tokens=256&calibrate.segment_tokens=128&calibrate.group_layers=1")
    with _engine(url, model) as first:
        assert "installed; calibrating it now" in caplog.text
        first.store(tokens, kv)
        _wait_for_puts(first, 2)
    caplog.clear()
    monkeypatch.setattr(calmod, "_registered", {})  # as in a new process
    with _engine(url, model) as second:
        assert "using the installed calibration" in caplog.text and "calibrating" not in caplog.text
        assert second.lookup(tokens) == 512
        got, n = second.retrieve(tokens, kv)
        kvtc = second.remote_connector().store.codec  # kvtc over the calibration named by the model identity
    assert n == 512
    # LMCache hands over each chunk alone, without its place in the sequence: kvtc codes it at positions 0..255
    own = [kvcodec.decode(kvcodec.encode(kvcodec.KVCache.from_lmcache(kv[:, :, s:s + 256], H), kvtc, chunk_tokens=256))
           for s in (0, 256)]
    assert torch.equal(got, torch.cat([o.to_lmcache() for o in own], 2).to(got.dtype))
    assert float((got.float() - kv.float()).abs().max()) > 0  # lossy: the KV did go through kvtc
