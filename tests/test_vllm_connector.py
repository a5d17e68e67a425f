"""The vLLM connector on the CPU, without vLLM: fake requests, scheduler outputs and forward contexts
carrying only the attributes the connector reads, real paged tensors and a real KVStore."""

from __future__ import annotations

import itertools
import threading
import time
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

import kvcodec.engines.vllm_connector as vc
import kvcodec.engines.vllm_connector.scheduler as scheduler_module
import kvcodec.engines.vllm_connector.worker as worker_module
import kvcodec.layouts.paged as paged_module
import kvcodec.layouts.sinks as sinks_module
from kvcodec.cache import KVCache
from kvcodec.engines.vllm_connector import KVCodecConnector, KVCodecConnectorMetadata, KVConnectorRole
from kvcodec.engines.vllm_connector.setup import connector_store, vllm_identity
from kvcodec.codecs.kvtc import MissingCalibrationError
from kvcodec.errors import CorruptDataError, InvalidInputError, UnsupportedError
from kvcodec.layouts.paged import read_paged, slot_mapping, write_paged
from kvcodec.codecs.raw import Raw
from kvcodec.store import CacheIdentity, KVStore, MemoryTier, PrefixLoad
from kvcodec.store.telemetry import RateEstimator
from kvcodec.tools.harness import wait_until

L, H, D, BS, NB = 3, 2, 8, 8, 40
CHUNK = 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def _kv(n: int, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache([(torch.randn(H, n, D, generator=g).half(), torch.randn(H, n, D, generator=g).half()) for _ in range(L)],
                   model="m", rope="post")


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _config(extra: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="KVCodecConnector",
                                                              kv_connector_module_path="kvcodec.engines.vllm_connector",
                                                              kv_role="kv_both", kv_connector_extra_config=extra or {}),
                           cache_config=SimpleNamespace(block_size=BS), model_config=SimpleNamespace(model="m"))


def _paged() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(2, NB, BS, H, D, dtype=torch.float16) for n in NAMES}


def _table(n_tokens: int, seed: int) -> list[int]:
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(seed)).tolist()
    return perm[: -(-n_tokens // BS)]


def _sched_out(rid: str, ids: list[int], blocks: list[int], computed: int = 0, scheduled: int | None = None):
    new = SimpleNamespace(req_id=rid, prompt_token_ids=ids, block_ids=(blocks,), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={rid: len(ids) - computed if scheduled is None else scheduled})


def _forward(worker: KVCodecConnector, meta: KVCodecConnectorMetadata, caches: dict[str, torch.Tensor],
             sched: KVCodecConnector | None = None) -> set[int]:
    """What vLLM's model runner does around one forward pass; then, as vLLM's next steps would, the step's saves
    are waited for and reported to ``sched``."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace(attn_metadata=None, no_compile_layers={}))
    for name in NAMES:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, caches[name], None)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    assert worker.get_finished({"x"}) == (None, None)
    worker.clear_connector_metadata()
    _saves_run(worker, sched, {s.req_id for s in meta.saves})
    return errors


def _saves_run(worker: KVCodecConnector, sched: KVCodecConnector | None, req_ids: set[str]) -> None:
    """Step on (vLLM's worker metadata to ``sched``) until the workers report the saves of ``req_ids`` run."""
    deadline = time.monotonic() + 30
    while req_ids:
        ran = worker.build_connector_worker_meta()
        if ran is not None:
            req_ids -= set(ran.saves_run)
            if sched is not None:
                sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=ran))
        assert time.monotonic() < deadline, f"saves of {req_ids} never ran"
        time.sleep(0.002)


def _pair(store: KVStore) -> tuple[KVCodecConnector, KVCodecConnector, dict[str, torch.Tensor]]:
    # a fresh engine whose predecessors' steps computed nothing (their KV written by hand, as here): their times
    # are no prefill speed, and the store keeps the worker's for the next engine
    store.telemetry.prefill = RateEstimator(prior=1.0)
    sched = KVCodecConnector(_config(), KVConnectorRole.SCHEDULER, store=store)
    worker = KVCodecConnector(_config(), KVConnectorRole.WORKER, store=store)
    caches = _paged()
    worker.register_kv_caches(caches)
    return sched, worker, caches


def _prefill(sched, worker, caches, rid: str, ids: list[int], kv: KVCache, blocks: list[int]) -> None:
    """A prompt that misses the store: vLLM computes it into its blocks and the connector saves it."""
    req = SimpleNamespace(request_id=rid, prompt_token_ids=ids)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, None, 0)
    slots = slot_mapping(torch.tensor(blocks), 0, len(ids), BS)
    for name, layer in zip(NAMES, kv.layers):
        write_paged(caches[name], layer.keys, layer.values, slots)
    meta = sched.build_connector_meta(_sched_out(rid, ids, blocks))
    assert not meta.loads and [s.req_id for s in meta.saves] == [rid]
    assert _forward(worker, meta, caches, sched) == set()
    assert sched.request_finished(req, (blocks,)) == (False, None)


# --- paged layout -------------------------------------------------------------------------------

def test_paged_scatter_gather_shuffled_table():
    kv = _kv(100)
    table = torch.tensor(_table(100, seed=3))
    slots = slot_mapping(table, 0, 100, BS)
    paged = torch.zeros(2, NB, BS, H, D, dtype=torch.float16)
    layer = kv.layers[0]
    write_paged(paged, layer.keys, layer.values, slots)
    for t in (0, 7, 8, 63, 99):  # token t sits in block table[t // BS] at offset t % BS
        b, o = int(table[t // BS]), t % BS
        assert torch.equal(paged[0, b, o], layer.keys[:, t]) and torch.equal(paged[1, b, o], layer.values[:, t])
    k, v = read_paged(paged, slots)
    assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    # a sub-range starting mid-block
    k2, v2 = read_paged(paged, slot_mapping(table, 13, 50, BS))
    assert torch.equal(k2, layer.keys[:, 13:63]) and torch.equal(v2, layer.values[:, 13:63])
    # blocks outside the table are untouched
    unused = sorted(set(range(NB)) - set(table.tolist()))
    assert not paged[:, unused].any()


# --- scheduler side -----------------------------------------------------------------------------

def test_lookup_counts_whole_blocks_minus_computed():
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=20)
    sched, _, _ = _pair(store)
    ids, kv = _ids(100), _kv(100)
    store.put(ids, KVCache([(l.keys, l.values) for l in kv.layers], model="m", token_ids=ids, rope="post"))
    req = SimpleNamespace(request_id="r", prompt_token_ids=ids + _ids(10, seed=9))
    # 5 full chunks of 20 match = 100 tokens, rounded down to whole blocks of 8: 96
    assert sched.get_num_new_matched_tokens(req, 0) == (96, False)
    assert sched.get_num_new_matched_tokens(req, 32) == (64, False)
    assert sched.get_num_new_matched_tokens(req, 96) == (0, False)
    assert sched.stats["lookups"] == 3 and sched.stats["lookup_hit_tokens"] == 3 * 96
    # at least one prompt token is left for vLLM to compute
    exact = SimpleNamespace(request_id="e", prompt_token_ids=ids[:80])
    # all 4 chunks of the 80 tokens match; less the token vLLM computes, 79 -> 72 whole blocks (the 4th chunk is
    # loaded in part, rather than missed because a 19-token prefix of it has another key)
    assert sched.get_num_new_matched_tokens(exact, 0) == (72, False)
    other = SimpleNamespace(request_id="o", prompt_token_ids=_ids(100, seed=5))
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(SimpleNamespace(request_id="z", prompt_token_ids=[]), 0) == (0, False)


def test_lookup_failure_is_a_miss():
    class Broken(MemoryTier):
        def contains(self, key):
            raise ConnectionError("down")

    store = KVStore([Broken(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    sched = KVCodecConnector(_config(), KVConnectorRole.SCHEDULER, store=store)
    assert sched.get_num_new_matched_tokens(SimpleNamespace(request_id="r", prompt_token_ids=_ids(100)), 0) == (0, False)


# --- save, then load into fresh paged tensors -----------------------------------------------

def test_save_then_load_raw_bit_exact():
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    ids, kv = _ids(100), _kv(100)
    _prefill(sched, worker, caches, "a", ids, kv, _table(100, seed=1))
    assert store.lookup(ids).num_tokens == 100 and worker.stats["saved_chunks"] == 4

    # a second engine (fresh paged memory, another shuffled table) gets a request sharing the prompt
    sched2, worker2, fresh = _pair(store)
    ids2 = ids + _ids(10, seed=7)
    req = SimpleNamespace(request_id="b", prompt_token_ids=ids2)
    computed = 16  # vLLM's own prefix cache already holds two blocks
    ext, is_async = sched2.get_num_new_matched_tokens(req, computed)
    assert (ext, is_async) == (96 - computed, False)  # chunks 0..2 (96 tokens); the partial 4th chunk differs
    sched2.update_state_after_alloc(req, None, ext)
    blocks = _table(len(ids2), seed=2)
    meta = sched2.build_connector_meta(_sched_out("b", ids2, blocks, computed=computed + ext))
    assert [(l.req_id, l.start, l.end) for l in meta.loads] == [("b", 16, 96)]
    assert _forward(worker2, meta, fresh) == set()
    slots = slot_mapping(torch.tensor(blocks), 0, 96, BS)
    for name, layer in zip(NAMES, kv.layers):
        k, v = read_paged(fresh[name], slots)
        assert torch.equal(k[:, 16:], layer.keys[:, 16:96]) and torch.equal(v[:, 16:], layer.values[:, 16:96])
        assert not k[:, :16].any()  # what vLLM already had is not overwritten
    assert worker2.stats["loaded_tokens"] == 80


def test_chunked_prefill_saves_when_prompt_completes():
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    sched, _, _ = _pair(store)
    ids = _ids(100)
    req = SimpleNamespace(request_id="c", prompt_token_ids=ids)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, 0)
    table = _table(100, seed=4)
    meta = sched.build_connector_meta(_sched_out("c", ids, table[:8], scheduled=64))
    assert not meta.saves
    cached = SimpleNamespace(req_ids=["c"], new_block_ids=[(table[8:],)], num_computed_tokens=[64], resumed_req_ids=set())
    meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                                                      num_scheduled_tokens={"c": 36}))
    assert len(meta.saves) == 1 and meta.saves[0].block_ids == table and meta.saves[0].token_ids == ids


# --- faults: reported as load errors, never raised ------------------------------------------

def _stored(store: KVStore):
    sched, worker, caches = _pair(store)
    ids, kv = _ids(100), _kv(100)
    _prefill(sched, worker, caches, "a", ids, kv, _table(100, seed=1))
    return ids, kv


def _load(store: KVStore, ids: list[int], between: Callable[[], None] = lambda: None
          ) -> tuple[set[int], list[int], dict[str, torch.Tensor], int, KVCodecConnector]:
    """A second request extending ``ids`` by 10 tokens: the scheduler's lookup, ``between``, then the worker's
    load; returns the blocks reported failed, the block table, the paged tensors, the matched tokens and the
    worker."""
    sched, worker, fresh = _pair(store)
    ids2 = ids + _ids(10, seed=7)
    req = SimpleNamespace(request_id="b", prompt_token_ids=ids2)
    ext, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, ext)
    between()
    blocks = _table(len(ids2), seed=2)
    meta = sched.build_connector_meta(_sched_out("b", ids2, blocks, computed=ext))
    return _forward(worker, meta, fresh, sched), blocks, fresh, ext, worker


def test_corrupt_chunk_reported_not_raised():
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    ids, kv = _stored(store)
    tier = store.tiers[0]
    key = store.keys_for(ids)[1][0]

    def damage() -> None:  # between the scheduler's lookup and the worker's load, chunk 1 (tokens 32..63)
        blob = bytearray(tier.get(key))
        blob[len(blob) // 2] ^= 0xFF
        tier.put(key, bytes(blob))

    errors, blocks, fresh, ext, worker = _load(store, ids, damage)
    assert ext == 96
    assert errors == set(blocks[32 // BS: 96 // BS])  # chunk 1 and everything after it
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    slots = slot_mapping(torch.tensor(blocks), 0, 32, BS)
    for name, layer in zip(NAMES, kv.layers):  # chunk 0 arrived intact
        assert torch.equal(read_paged(fresh[name], slots)[0], layer.keys[:, :32])
    assert store.lookup(ids).num_tokens == 32 and not tier.contains(key)  # the damaged chunk is evicted


@pytest.mark.parametrize("fault, evicted", [(CorruptDataError("section does not decode"), True),
                                             (MemoryError(), False), (MissingCalibrationError("not here"), False)])
def test_chunk_that_fails_to_decode_is_reported_and_evicted_only_when_bad(monkeypatch, fault, evicted):
    """A chunk whose data is bad is evicted; a fault of this machine (memory, a calibration it lacks) is a load
    error that leaves the shared entry alone."""
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    ids, kv = _stored(store)
    bad_key = store.keys_for(ids)[2][0]
    bad = store.source.read(bad_key, 64, 96).sections[1]  # passes its checksums, then fails to decode
    real = Raw.decode_layer

    def flaky(self, data, ctx):
        if data == bad and ctx.layer == 1:
            raise fault
        return real(self, data, ctx)

    monkeypatch.setattr(Raw, "decode_layer", flaky)
    errors, blocks, fresh, ext, _ = _load(store, ids)
    assert ext == 96 and errors == set(blocks[64 // BS: 96 // BS])
    slots = slot_mapping(torch.tensor(blocks), 0, 64, BS)
    for name, layer in zip(NAMES, kv.layers):
        assert torch.equal(read_paged(fresh[name], slots)[1], layer.values[:, :64])
    assert store.tiers[0].contains(bad_key) != evicted


def test_missing_chunk_reported():
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    ids, _ = _stored(store)
    # gone before the worker gets to it (another engine evicted it)
    errors, blocks, _, _, _ = _load(store, ids, lambda: store.evict(ids))
    assert errors == set(blocks[: 96 // BS])


# --- configuration ---------------------------------------------------------------------------

def test_store_from_extra_config_shared_through_disk(tmp_path):
    extra = {"codec": "raw", "chunk_tokens": CHUNK, "tiers": ["cpu:1000000", f"disk:{tmp_path / 'kv'}"], "model": "m"}
    store = connector_store(extra, "ignored", CacheIdentity())
    assert [t.name for t in store.tiers] == ["cpu", "disk"] and store.codec.codec_id == "raw" and store.model == "m"
    # the scheduler and the worker are separate processes in vLLM: separate stores, shared through disk
    sched = KVCodecConnector(_config(extra), KVConnectorRole.SCHEDULER)
    worker = KVCodecConnector(_config(extra), KVConnectorRole.WORKER)
    assert sched.store is not worker.store
    caches = _paged()
    worker.register_kv_caches(caches)
    ids, kv = _ids(100), _kv(100)
    _prefill(sched, worker, caches, "a", ids, kv, _table(100, seed=1))
    req = SimpleNamespace(request_id="b", prompt_token_ids=ids + [1, 2, 3])
    assert sched.get_num_new_matched_tokens(req, 0) == (96, False)
    with pytest.raises(ValueError):
        connector_store({"tiers": ["tape"]}, "m", CacheIdentity())


def test_connector_is_vllm_base_subclass_when_available():
    if vc.HAVE_VLLM:  # pragma: no cover - not installed here
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        assert issubclass(KVCodecConnector, KVConnectorBase_V1)
    else:
        assert KVCodecConnector.__module__ == "kvcodec.engines.vllm_connector.connector"
        with pytest.raises(ValueError):
            KVCodecConnector(SimpleNamespace(kv_transfer_config=None), KVConnectorRole.WORKER)


def test_loadable_by_module_path(caplog):
    """What vLLM's KVConnectorFactory does with kv_connector_module_path and kv_connector."""
    import importlib
    import json

    cfg = json.loads('{"kv_connector":"KVCodecConnector","kv_connector_module_path":"kvcodec.engines.vllm_connector",'
                     '"kv_role":"kv_both","kv_connector_extra_config":{"codec":"raw","tiers":["cpu"]}}')
    cls = getattr(importlib.import_module(cfg["kv_connector_module_path"]), cfg["kv_connector"])
    conn = cls(vllm_config=_config(cfg["kv_connector_extra_config"]), role=KVConnectorRole.WORKER, kv_cache_config=None)
    assert conn.role == KVConnectorRole.WORKER and conn.store.codec.codec_id == "raw"
    # a process-private tier alone says at start-up that the scheduler will never find what the worker saves
    assert any("private to each process" in r.getMessage() for r in caplog.records)
    with pytest.raises(UnsupportedError, match="KV cache of attention backend"):  # a layout it does not know
        conn.register_kv_caches({"l0": torch.zeros(NB, 2, BS, H, D)})


# --- never serve the wrong KV ----------------------------------------------------------------

def test_a_failed_layer_write_stays_reported_whatever_the_later_layers_do(monkeypatch):
    """The write of layer 1 into vLLM's memory fails: the request's blocks are load errors, and the stored chunks,
    nothing wrong with them, stay."""
    store = KVStore([MemoryTier(None)], model="m", codec="cachegen", chunk_tokens=CHUNK)
    ids, _ = _stored(store)
    real = paged_module.write_paged

    def failing(paged, keys, values, slots, layout):
        if paged.data_ptr() == failing.target:
            raise RuntimeError("simulated failure writing layer 1")
        return real(paged, keys, values, slots, layout)

    sched, worker, fresh = _pair(store)
    failing.target = fresh[NAMES[1]].data_ptr()
    monkeypatch.setattr(paged_module, "write_paged", failing)  # the codec's paged decode writes with it
    monkeypatch.setattr(sinks_module, "write_paged", failing)  # and a load's dense path
    ids2 = ids + _ids(10, seed=7)
    for attempt in range(5):
        req = SimpleNamespace(request_id=f"w{attempt}", prompt_token_ids=ids2)
        ext, _ = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, None, ext)
        blocks = _table(len(ids2), seed=2)
        meta = sched.build_connector_meta(_sched_out(req.request_id, ids2, blocks, computed=ext))
        assert ext == 96 and _forward(worker, meta, fresh, sched) == set(blocks[: 96 // BS])
    assert store.lookup(ids).num_tokens == 100  # nothing wrong with the stored chunks: nothing evicted


def _parallel_config(rank: int, tp: int = 2) -> SimpleNamespace:
    cfg = _config({"codec": "raw", "chunk_tokens": CHUNK})
    cfg.parallel_config = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, rank=rank)
    cfg.model_config.dtype = torch.float16
    return cfg


def test_tensor_parallel_ranks_keep_their_own_heads(tmp_path):
    """Rank 1 neither skips its save because rank 0's chunk exists nor loads rank 0's heads."""
    folder = tmp_path / "kv"
    extra = {"codec": "raw", "chunk_tokens": CHUNK, "tiers": [f"disk:{folder}"]}
    stores = []
    for rank in (0, 1):
        cfg = _parallel_config(rank)
        cfg.kv_transfer_config.kv_connector_extra_config = extra
        worker = KVCodecConnector(cfg, KVConnectorRole.WORKER)
        assert worker.store.identity.tp_rank == rank and worker.store.identity.tp_size == 2
        assert worker.store.identity.kv_dtype == "float16"
        stores.append(worker.store)
    ids = _ids(100)
    assert stores[0].put(ids, _kv(100, seed=0)) == 4
    assert stores[1].lookup(ids).num_tokens == 0
    assert stores[1].put(ids, _kv(100, seed=1), replicate=False) == 4  # its own heads, saved beside rank 0's
    got = [s.get(ids) for s in stores]
    assert torch.equal(got[0].layers[0].keys, _kv(100, seed=0).layers[0].keys)
    assert torch.equal(got[1].layers[0].keys, _kv(100, seed=1).layers[0].keys)


def test_lora_and_multimodal_requests_the_keys_cannot_cover_are_neither_loaded_nor_saved(caplog):
    """An adapter whose files are not on this machine, a multimodal item without a content hash: logged once per
    kind, never keyed by their tokens alone."""
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    ids, _ = _stored(store)
    sched, _, _ = _pair(store)
    kinds = [("lora_request", SimpleNamespace(lora_name="a", lora_int_id=1)), ("mm_features", [object()])]
    with caplog.at_level("WARNING"):
        for n, (attr, value) in enumerate(kinds * 2):
            req = SimpleNamespace(request_id=f"r{n}", prompt_token_ids=ids, **{attr: value})
            assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
            sched.update_state_after_alloc(req, None, 0)
            meta = sched.build_connector_meta(_sched_out(req.request_id, ids, _table(100, seed=3)))
            assert not meta.loads and not meta.saves
    said = [r.getMessage() for r in caplog.records if "neither loaded" in r.getMessage()]
    assert len(said) == 2 and "LoRA" in said[0] and "multimodal" in said[1]  # once per kind


def test_cache_salt_keys_requests_apart():
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    ids, kv = _ids(100), _kv(100)
    req = SimpleNamespace(request_id="s", prompt_token_ids=ids, cache_salt="tenant-a")
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, None, 0)
    blocks = _table(100, seed=1)
    for name, layer in zip(NAMES, kv.layers):
        write_paged(caches[name], layer.keys, layer.values, slot_mapping(torch.tensor(blocks), 0, 100, BS))
    _forward(worker, sched.build_connector_meta(_sched_out("s", ids, blocks)), caches, sched)
    for salt, hit in (("tenant-a", 96), ("tenant-b", 0), (None, 0)):
        other = SimpleNamespace(request_id=f"t-{salt}", prompt_token_ids=ids + [5], cache_salt=salt)
        assert sched.get_num_new_matched_tokens(other, 0) == (hit, False)


def test_a_chunk_of_another_head_count_is_a_load_error_not_broadcast():
    """A chunk declaring one KV head where the engine has two: refused, evicted, and vLLM's memory untouched."""
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    ids, _ = _stored(store)
    one_head = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    kv1 = KVCache([(l.keys[:1], l.values[:1]) for l in _kv(100).layers], model="m", rope="post")
    one_head.put(ids, kv1)
    key = store.keys_for(ids)[1][0]
    store.tiers[0].put(key, one_head.tiers[0].get(key))
    errors, blocks, fresh, ext, _ = _load(store, ids)
    assert ext == 96 and errors == set(blocks[32 // BS: 96 // BS])
    slots = slot_mapping(torch.tensor(blocks), 32, 64, BS)
    assert not any(read_paged(fresh[name], slots)[0].any() for name in NAMES)
    assert not store.tiers[0].contains(key)


def test_write_paged_refuses_what_it_would_broadcast():
    paged = torch.zeros(2, NB, BS, H, D, dtype=torch.float16)
    one = torch.ones(1, 8, D, dtype=torch.float16)
    with pytest.raises(InvalidInputError, match="heads"):
        write_paged(paged, one, one, slot_mapping(torch.tensor([0]), 0, 8, BS))
    assert not paged.any()


def test_the_worker_times_prefill_and_leaves_a_load_to_vllm_when_recomputing_is_sooner(monkeypatch):
    """A step without loads times vLLM's prefill (tokens over the time from binding its metadata to its end); a
    later load whose every variant would arrive later than recomputing stops, and its blocks go back to vLLM."""
    store = KVStore([MemoryTier(None)], model="m", codec=["cachegen", "raw"], chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    ids, kv = _ids(100), _kv(100)
    clock = itertools.chain([0.0, 0.01], itertools.repeat(0.02))  # the prefill step: 100 tokens in 10 ms
    monkeypatch.setattr(worker_module.time, "perf_counter", lambda: next(clock))
    _prefill(sched, worker, caches, "a", ids, kv, _table(100, seed=1))
    monkeypatch.undo()
    assert worker.worker.prefill.samples == (100 / 0.01,)
    ids2 = ids + _ids(10, seed=7)
    req = SimpleNamespace(request_id="b", prompt_token_ids=ids2)
    ext, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, ext)
    # after the scheduler's claim (its estimates, the workers' last report, said loading was sooner), both variants
    # turn out to decode 1 k tokens/s: far slower than that prefill
    for codec in store.variants:
        store.telemetry.decode_rate(codec).observe(1000, 1.0)
    blocks = _table(len(ids2), seed=2)
    meta = sched.build_connector_meta(_sched_out("b", ids2, blocks, computed=ext))
    assert ext == 96 and _forward(worker, meta, _paged(), sched) == set(blocks[: 96 // BS])
    assert worker.stats["loaded_tokens"] == 0 and store.lookup(ids).num_tokens == 100  # nothing evicted


def test_the_scheduler_claims_no_hit_whose_load_the_workers_estimates_say_is_slower_than_computing(caplog,
                                                                                                 monkeypatch):
    """A raw hit over 100 Mbit/s that the worker's load gave back after 0-2 chunks took vLLM 1.2x a plain prefill
    (a pass of its own for the blocks given back): the scheduler weighs the workers' reported estimates first and
    leaves such a hit to vLLM; on a fast link it claims it; and once the latest link measurement is older than
    LINK_RECHECK_S it claims again, so that the worker's load measures the link (a refused hit reads nothing)."""
    tier = MemoryTier(None)
    worker_store, sched_store = (KVStore([tier], model="m", codec="raw", chunk_tokens=CHUNK) for _ in range(2))
    sched = KVCodecConnector(_config(), KVConnectorRole.SCHEDULER, store=sched_store)
    worker = KVCodecConnector(_config(), KVConnectorRole.WORKER, store=worker_store)
    worker.register_kv_caches(_paged())
    ids = _ids(100)
    worker_store.put(ids, KVCache(_kv(100).layers, model="m", token_ids=ids, rope="post"))
    req = SimpleNamespace(request_id="r", prompt_token_ids=ids + [5])
    assert sched.get_num_new_matched_tokens(req, 0) == (96, False)  # nothing reported yet: claimed
    worker_store.telemetry.prefill.observe(1000, 1.0)  # vLLM computes 1 k tokens/s
    for bps, hit in ((10_000, 0), (1e9, 96)):  # 19 KB of raw KV: 1.9 s on the slow link, 19 us on the fast one
        worker_store.telemetry.observe_read(tier.name, int(bps), 1.0)
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_connector_worker_meta()))
        with caplog.at_level("INFO"):
            assert sched.get_num_new_matched_tokens(req, 0) == (hit, False)
    assert "loading tokens 0-96 would take 1.9" in caplog.text and "left to vLLM" in caplog.text
    worker_store.telemetry.observe_read(tier.name, 10_000, 1.0)  # slow again
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_connector_worker_meta()))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    now = time.time()
    monkeypatch.setattr(scheduler_module.time, "time", lambda: now + scheduler_module.LINK_RECHECK_S + 1)
    assert sched.get_num_new_matched_tokens(req, 0) == (96, False)


def test_kvtc_is_calibrated_in_the_background_while_another_codec_serves(tmp_path, monkeypatch):
    """No calibration installed: the store serves with cachegen at once, calibrates (a stand-in fit here), then
    switches to kvtc; "now" would have waited for it."""
    import threading

    from kvcodec.codecs.kvtc import calibration as calmod
    from kvcodec.tools.fuzz.seeds import fuzz_calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(calmod.ENV_PATH, raising=False)
    monkeypatch.setattr(calmod, "_registered", {})
    release = threading.Event()
    calls = []

    def fit(name, load, log, options=None):
        calls.append(name)
        release.wait(10)
        return calmod.register_calibration(fuzz_calibration(_kv(64))).digest

    monkeypatch.setattr("kvcodec.engines.store_setup.ensure_model_calibration", fit)
    monkeypatch.setattr("kvcodec.engines.auto_calibration.ensure_model_calibration", fit)
    store = connector_store({"codec": "kvtc", "tiers": ["cpu"]}, "m", CacheIdentity())
    assert store.codec.codec_id == "cachegen"  # serving already, the fit still running
    release.set()
    for _ in range(100):
        if store.codec.codec_id == "kvtc":
            break
        time.sleep(0.05)
    assert store.codec.codec_id == "kvtc" and calls == ["m"]
    # variants: the ones that need no calibration serve meanwhile, then all of them
    monkeypatch.setattr(calmod, "_registered", {})
    release.clear()
    variants = connector_store({"codec": ["kvtc:level=0", "cachegen", "raw"], "tiers": ["cpu"]}, "m2", CacheIdentity())
    assert [c.codec_id for c in variants.variants] == ["cachegen", "raw"]
    release.set()
    for _ in range(100):
        if len(variants.variants) == 3:
            break
        time.sleep(0.05)
    assert [(c.codec_id, c.get_config().get("level")) for c in variants.variants] == \
        [("kvtc", 0), ("cachegen", 2), ("raw", None)] and calls[-1] == "m2"
    with pytest.raises(Exception, match="background"):
        connector_store({"codec": "kvtc", "tiers": ["cpu"], "calibrate": "later"}, "m", CacheIdentity())


# --- one identity: what the keys cover --------------------------------------------------------------

def _saved_by(sched, worker, caches, rid: str, ids: list[int], kv: KVCache, *, stored: int = 0, saved: bool = True,
              **request) -> None:
    """A request carrying ``request``'s inputs finds ``stored`` tokens, is computed whole and saved (unless
    ``saved`` is False: then the scheduler must schedule no save)."""
    req = SimpleNamespace(request_id=rid, prompt_token_ids=ids, **request)
    assert sched.get_num_new_matched_tokens(req, 0) == (stored, False)
    sched.update_state_after_alloc(req, None, 0)
    blocks = _table(len(ids), seed=1)
    for name, layer in zip(NAMES, kv.layers):
        write_paged(caches[name], layer.keys, layer.values, slot_mapping(torch.tensor(blocks), 0, len(ids), BS))
    meta = sched.build_connector_meta(_sched_out(rid, ids, blocks))
    assert [s.req_id for s in meta.saves] == ([rid] if saved else [])
    _forward(worker, meta, caches, sched)
    sched.request_finished(req, (blocks,))


def _hit(sched, rid: str, ids: list[int], **request) -> int:
    return sched.get_num_new_matched_tokens(SimpleNamespace(request_id=rid, prompt_token_ids=ids, **request), 0)[0]


def test_same_placeholder_ids_with_other_prompt_embeds_do_not_share_kv():
    """vLLM 0.32 prompts given as embeddings carry placeholder token ids: two of them with the same ids and other
    embeddings were keyed alike, and the second loaded the first's KV (a 96-token wrong hit here)."""
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    ids = [0] * 100  # the placeholder ids of an embeddings prompt
    embeds = [torch.randn(100, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    _saved_by(sched, worker, caches, "e1", ids, _kv(100), prompt_embeds=embeds[0])
    assert _hit(sched, "other", ids + [0], prompt_embeds=torch.cat([embeds[1], embeds[1][:1]])) == 0
    assert _hit(sched, "plain", ids + [0]) == 0  # nor does a prompt of those ids alone
    assert _hit(sched, "same", ids, prompt_embeds=embeds[0]) == 96  # the same embeddings still hit


def test_multimodal_items_key_requests_apart():
    """Same placeholder tokens, other image (vLLM's content hash ``identifier``) or the same image elsewhere: no hit."""
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    ids = _ids(100)

    def image(identifier: str, offset: int = 10) -> list[SimpleNamespace]:
        return [SimpleNamespace(modality="image", identifier=identifier,
                                mm_position=SimpleNamespace(offset=offset, length=40, is_embed=None))]

    _saved_by(sched, worker, caches, "i1", ids, _kv(100), mm_features=image("cat"))
    assert _hit(sched, "dog", ids, mm_features=image("dog")) == 0
    assert _hit(sched, "moved", ids, mm_features=image("cat", offset=20)) == 0
    assert _hit(sched, "cat", ids, mm_features=image("cat")) == 96


def test_lora_adapters_key_requests_apart(tmp_path, monkeypatch):
    """A request through an adapter on disk is keyed by the adapter's files: another adapter's bytes or settings
    (even under the same name and id) and the base model miss."""
    monkeypatch.setenv("KVCODEC_DIGEST_CACHE", str(tmp_path / "digests.json"))
    adapters = []
    for n, (weights, alpha) in enumerate([(0, 16), (1, 16), (0, 32)]):
        folder = tmp_path / f"adapter{n}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(f'{{"r": 8, "lora_alpha": {alpha}}}')
        (folder / "adapter_model.safetensors").write_bytes(bytes([weights]) * 64)
        adapters.append(SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path=str(folder)))
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    ids = _ids(100)
    _saved_by(sched, worker, caches, "l0", ids, _kv(100), lora_request=adapters[0])
    assert _hit(sched, "l1", ids, lora_request=adapters[1]) == 0
    assert _hit(sched, "l2", ids, lora_request=adapters[2]) == 0  # the same weights at another scale
    assert _hit(sched, "base", ids) == 0
    assert _hit(sched, "again", ids, lora_request=adapters[0]) == 96


def _model_folder(folder, weights: bytes):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 3}')
    with open(folder / "model.safetensors", "wb") as f:  # in place: the same file, rewritten
        f.write(weights)


def test_weights_replaced_in_place_get_other_keys(tmp_path, monkeypatch):
    """The model digest covered config.json and the revision only: a folder whose weights were replaced in place
    (a fine-tune keeping the base model's config) was served the base model's KV."""
    monkeypatch.setenv("KVCODEC_DIGEST_CACHE", str(tmp_path / "digests.json"))
    folder = tmp_path / "model"
    cfg = _config({"codec": "raw", "tiers": ["cpu"]})
    cfg.model_config.model = str(folder)
    keys = []
    for weights in (b"base" * 100, b"tune" * 100):
        _model_folder(folder, weights)
        time.sleep(0.01)  # a change time of its own
        identity = vllm_identity(cfg, is_worker=True)
        keys.append(KVCodecConnector(cfg, KVConnectorRole.WORKER).store.keys_for(_ids(64)))
        assert keys[-1] == connector_store({"codec": "raw", "tiers": ["cpu"]}, str(folder), identity).keys_for(_ids(64))
    assert keys[0][0][0] != keys[1][0][0]


# --- credentials -------------------------------------------------------------------------------------

def test_a_redis_password_in_the_extra_config_stops_the_start_and_is_not_shown():
    """vLLM logs kv_connector_extra_config at start: a password in a tier URL there was accepted (and logged)."""
    for url in ("redis://:hunter2@127.0.0.1:6379/0", "redis://alice:hun#ter?2@127.0.0.1:6379"):
        with pytest.raises(InvalidInputError, match="password_file") as e:
            KVCodecConnector(_config({"codec": "raw", "tiers": ["cpu", url]}), KVConnectorRole.SCHEDULER)
        assert "hunter2" not in str(e.value) and "hun#ter" not in str(e.value)


def test_redis_url_and_redis_timeout_s_are_no_longer_settings():
    for extra in ({"redis_url": "redis://127.0.0.1:6379"}, {"redis_timeout_s": 2}):
        with pytest.raises(InvalidInputError, match="unknown setting"):
            KVCodecConnector(_config(extra), KVConnectorRole.SCHEDULER)


def test_password_file_reaches_a_redis_that_requires_auth(redis_server, tmp_path):
    import redis

    admin = redis.Redis(port=redis_server.port)
    admin.config_set("requirepass", "s3cret-pw")
    admin.close()
    (tmp_path / "pw").write_text("s3cret-pw\n")
    url = f"redis://127.0.0.1:{redis_server.port}?password_file={tmp_path / 'pw'}&timeout=2"
    extra = {"codec": "raw", "chunk_tokens": CHUNK, "tiers": [url]}
    sched = KVCodecConnector(_config(extra), KVConnectorRole.SCHEDULER)
    worker = KVCodecConnector(_config(extra), KVConnectorRole.WORKER)
    caches = _paged()
    worker.register_kv_caches(caches)
    ids = _ids(100)
    _prefill(sched, worker, caches, "a", ids, _kv(100), _table(100, seed=1))
    assert worker.stats["saved_chunks"] == 4
    assert sched.get_num_new_matched_tokens(SimpleNamespace(request_id="b", prompt_token_ids=ids + [1]), 0) == (96, False)
    anonymous = KVCodecConnector(_config({**extra, "tiers": [f"redis://127.0.0.1:{redis_server.port}?timeout=2"]}),
                                 KVConnectorRole.SCHEDULER)
    assert anonymous.get_num_new_matched_tokens(SimpleNamespace(request_id="c", prompt_token_ids=ids + [1]), 0) == (0, False)


# --- no completion lost ------------------------------------------------------------------------------

def test_a_load_that_fails_to_finish_is_reported_and_the_others_still_finish(monkeypatch):
    """Two loads in one forward pass, the first one's finish raises: it used to escape into vLLM, leaving the
    second load unrecorded; now the first's blocks are load errors and the second's tokens are in."""
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    ids, kv = _stored(store)
    sched, worker, fresh = _pair(store)
    real, calls = PrefixLoad.finish, []

    def finish(self):
        calls.append(self)
        if len(calls) == 1:
            raise RuntimeError("simulated fault in the load path")
        return real(self)

    monkeypatch.setattr(PrefixLoad, "finish", finish)
    ids2 = ids + _ids(10, seed=7)
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(2)).tolist()
    tables = {"x": perm[:14], "y": perm[14:28]}  # 14 blocks of 8 each for the 110 tokens
    new = []
    for rid in tables:
        req = SimpleNamespace(request_id=rid, prompt_token_ids=ids2)
        ext, _ = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, None, ext)
        new.append(SimpleNamespace(req_id=rid, prompt_token_ids=ids2, block_ids=(tables[rid],), num_computed_tokens=ext))
    meta = sched.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=new, scheduled_cached_reqs=None, num_scheduled_tokens={rid: 14 for rid in tables}))
    assert len(meta.loads) == 2
    errors = _forward(worker, meta, fresh, sched)
    assert errors == set(tables["x"][: 96 // BS])
    assert worker.stats["loaded_tokens"] == 96 and len(calls) == 2


def test_a_load_logs_one_line_with_its_bytes_used_and_wasted(caplog):
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    ids, _ = _stored(store)
    used = sum(len(store.tiers[0].get(k)) for k, _, _ in store.keys_for(ids)[:3])
    with caplog.at_level("INFO"):
        _load(store, ids)
    lines = [r.getMessage() for r in caplog.records if "loaded tokens" in r.getMessage()]
    assert len(lines) == 1 and f", {used} bytes, variants ['raw', 'raw', 'raw'], 0 bytes wasted" in lines[0], lines


def test_a_save_logs_one_line_as_a_load_does(caplog):
    """A save logged nothing while a hit logged one line: each saved prompt now says its new chunks, bytes, variants
    and time, at the load's level."""
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    with caplog.at_level("INFO"):
        _saved_by(sched, worker, caches, "first", _ids(100), _kv(100))
    saved = [r for r in caplog.records if "saved" in r.getMessage()]
    assert len(saved) == 1 and saved[0].levelname == "INFO"
    value_bytes = store.stats["put_bytes"]
    assert value_bytes > 0 and "saved 4 new chunk(s) of tokens 0-100" in saved[0].getMessage()
    assert f", {value_bytes} bytes, variants ['raw']" in saved[0].getMessage()
    caplog.clear()
    with caplog.at_level("INFO"):  # the same prompt again: nothing new to save, nothing scheduled, nothing said
        _saved_by(sched, worker, caches, "again", _ids(100), _kv(100), stored=96, saved=False)
    assert store.stats["put_bytes"] == value_bytes
    assert not [r for r in caplog.records if "saved" in r.getMessage()]


def test_a_prompt_stored_in_every_variant_is_not_copied_out_to_be_saved_again():
    """Every request's save copied its prompt's KV out of vLLM's memory during the forward pass, and the store then
    wrote nothing where it held every chunk (a 2,048-token hit copied 94 MB, on a fresh engine's first request
    too).  Now such a save is not scheduled; a prompt missing one variant of one chunk is still saved, and that
    variant written."""
    store = KVStore([MemoryTier(None)], model="m", codec=["cachegen", "raw"], chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    ids = _ids(100)
    _saved_by(sched, worker, caches, "first", ids, _kv(100))
    assert store.lookup(ids).in_every_variant == 100
    _saved_by(sched, worker, caches, "again", ids, _kv(100), stored=96, saved=False)
    missing = store.variant_keys(ids)[1][2][0]  # chunk 1's cachegen value
    store.delete(missing)
    assert store.lookup(ids).num_tokens == 100 and store.lookup(ids).in_every_variant == CHUNK
    _saved_by(sched, worker, caches, "third", ids, _kv(100), stored=96)
    assert store.holds(missing)


# --- saves behind the step: a slow tier delays no token, and a prompt still finds what an earlier one saved -----

class _GatedTier(MemoryTier):
    """A memory tier whose writes wait for ``gate`` (a slow link), or fail once it is set with ``fail``."""

    def __init__(self) -> None:
        super().__init__(None)
        self.gate, self.fail, self.entered = threading.Event(), False, threading.Event()

    def put(self, key: str, value: bytes) -> bool:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.fail:
            raise ConnectionError("simulated: the tier went away")
        return super().put(key, value)


def _saving(ids: list[int], kv: KVCache) -> tuple[_GatedTier, KVStore, KVCodecConnector, KVCodecConnector,
                                                   dict[str, torch.Tensor]]:
    """A pair over a gated tier whose request "first" (``ids``) has had its step: its save waits on the gate."""
    tier = _GatedTier()
    store = KVStore([tier], model="m", codec="raw", chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    _step_with_save(sched, worker, caches, "first", ids, kv)
    return tier, store, sched, worker, caches


def _step_with_save(sched, worker, caches, rid: str, ids: list[int], kv: KVCache) -> None:
    """A miss whose prefill completes in this step; returns once vLLM's step would (``wait_for_save``)."""
    req = SimpleNamespace(request_id=rid, prompt_token_ids=ids)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, None, 0)
    blocks = _table(len(ids), seed=1)
    for name, layer in zip(NAMES, kv.layers):
        write_paged(caches[name], layer.keys, layer.values, slot_mapping(torch.tensor(blocks), 0, len(ids), BS))
    worker.bind_connector_metadata(sched.build_connector_meta(_sched_out(rid, ids, blocks)))
    worker.start_load_kv(None)
    for name in NAMES:
        worker.save_kv_layer(name, caches[name], None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    for name in NAMES:  # vLLM reuses the blocks at once: the save must hold its own copy
        caches[name].zero_()
    assert sched.request_finished(req, (blocks,)) == (False, None)  # and the request keeps no blocks for it


def test_a_save_runs_behind_the_step_and_a_prompt_that_needs_it_waits_for_it():
    """Issue 33 (a miss over 100 Mbit/s took 2.0-2.3x a plain prefill): the step returns while the tier is still
    writing; a prompt that would load the chunks being saved waits (vLLM asks again) and then loads them, bit-exact
    although vLLM's memory was reused meanwhile; a prompt that shares none of them does not wait."""
    ids, kv = _ids(100), _kv(100)
    tier, store, sched, worker, caches = _saving(ids, kv)
    assert store.lookup(ids).num_tokens == 0 and worker.worker.saves.pending_bytes > 0
    again = SimpleNamespace(request_id="again", prompt_token_ids=ids + _ids(10, seed=9))
    assert sched.get_num_new_matched_tokens(again, 0) == (None, False)  # not yet: the save would supply it
    unrelated = SimpleNamespace(request_id="unrelated", prompt_token_ids=_ids(100, seed=5))
    assert sched.get_num_new_matched_tokens(unrelated, 0) == (0, False)
    tier.gate.set()
    _saves_run(worker, sched, {"first"})
    assert sched.get_num_new_matched_tokens(again, 0) == (96, False)
    sched.update_state_after_alloc(again, None, 96)
    blocks = _table(110, seed=4)
    meta = sched.build_connector_meta(_sched_out("again", again.prompt_token_ids, blocks, computed=0, scheduled=14))
    assert _forward(worker, meta, caches, sched) == set()
    for name, layer in zip(NAMES, kv.layers):  # loaded into the memory zeroed after the save's step
        k, v = read_paged(caches[name], slot_mapping(torch.tensor(blocks), 0, 96, BS))
        assert torch.equal(k, layer.keys[:, :96]) and torch.equal(v, layer.values[:, :96])


def test_a_save_waits_between_its_chunks_while_a_step_loads():
    """A load is a request's first token and a save is not: from a step's loads' start to its end, a save under way
    writes no further chunk (it would share the link and the cores with the load)."""
    ids, stored = _ids(100), _ids(100, seed=6)
    tier = _GatedTier()
    store = KVStore([tier], model="m", codec="raw", chunk_tokens=CHUNK)
    tier.gate.set()
    store.put(stored, KVCache(_kv(100, seed=6).layers, model="m", token_ids=stored, rope="post"))
    tier.gate.clear()
    tier.entered.clear()
    sched, worker, caches = _pair(store)
    _step_with_save(sched, worker, caches, "first", ids, _kv(100))  # its save holds in its first chunk's write
    req = SimpleNamespace(request_id="hit", prompt_token_ids=stored + [7])
    ext, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, ext)
    meta = sched.build_connector_meta(_sched_out("hit", req.prompt_token_ids, _table(101, seed=5), computed=ext))
    assert ext == 96 and meta.loads
    assert tier.entered.wait(10)  # "first"'s save is in its first chunk's write
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # the step's loads start: "first"'s save is held before its next chunk
    tier.gate.set()
    wait_until("first's first chunk", lambda: store.lookup(ids).num_tokens == CHUNK, 10)
    time.sleep(0.2)
    assert store.lookup(ids).num_tokens == CHUNK
    for name in NAMES:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()  # the step ends: the save goes on
    _saves_run(worker, sched, {"first", "hit"})
    assert store.lookup(ids).num_tokens == 100


def test_a_failed_save_ends_the_wait_of_a_prompt_that_needed_it():
    """The tier fails the write: once the worker reports the save run, the waiting prompt is a miss (computed)."""
    ids = _ids(100)
    tier, _, sched, worker, _ = _saving(ids, _kv(100))
    again = SimpleNamespace(request_id="again", prompt_token_ids=ids)
    assert sched.get_num_new_matched_tokens(again, 0) == (None, False)
    tier.fail = True
    tier.gate.set()
    _saves_run(worker, sched, {"first"})
    assert sched.get_num_new_matched_tokens(again, 0) == (0, False)


def test_a_save_counts_as_run_once_every_worker_reports_it():
    """With tensor parallelism each worker saves its rank's KV: a prompt waits until the last one has."""
    store = KVStore([MemoryTier(None)], model="m", codec="raw", chunk_tokens=CHUNK)
    config = _config()
    config.parallel_config = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)
    sched = KVCodecConnector(config, KVConnectorRole.SCHEDULER, store=store)
    ids = _ids(100)
    req = SimpleNamespace(request_id="first", prompt_token_ids=ids)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, 0)
    assert [s.req_id for s in sched.build_connector_meta(_sched_out("first", ids, _table(100, 1))).saves] == ["first"]
    again = SimpleNamespace(request_id="again", prompt_token_ids=ids)
    for reports, waits in ((0, True), (1, True), (1, False)):
        if reports:
            sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=vc.metadata.WorkerReport({"first": 1})))
        assert sched.get_num_new_matched_tokens(again, 0) == ((None, False) if waits else (0, False))


def test_shutdown_writes_every_queued_save():
    ids = _ids(100)
    tier, store, _, worker, _ = _saving(ids, _kv(100))
    threading.Timer(0.2, tier.gate.set).start()
    worker.worker.close()  # what the connector's shutdown does before closing the store
    assert store.lookup(ids).num_tokens == 100


def test_the_saves_waiting_are_bounded_a_step_waits_for_room():
    from kvcodec.engines.vllm_connector.saves import BackgroundSaves

    gate, ran = threading.Event(), []
    saves = BackgroundSaves(max_bytes=100)
    saves.submit("a", 60, lambda: (gate.wait(30), ran.append("a")))
    second = threading.Thread(target=saves.submit, args=("b", 60, lambda: ran.append("b")))
    second.start()
    second.join(0.2)
    assert second.is_alive() and saves.pending_bytes == 60  # 120 bytes would pass the bound: it waits
    gate.set()
    second.join(10)
    assert saves.close(10) and ran == ["a", "b"] and saves.take_ran() == {"a", "b"}
    with pytest.raises(RuntimeError, match="closed"):
        saves.submit("c", 1, lambda: None)


# --- segments (issue 34): stored by one request, fused into another's blocks --------------------------------------

def _segment_request(rid: str, ids: list[int], **ours) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=ids, kv_transfer_params={"kvcodec": ours})


def _store_segments(sched, worker, caches, docs: list[list[int]]) -> None:
    for j, doc in enumerate(docs):
        req = _segment_request(f"doc{j}", doc, store_segment=True)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, None, 0)
        blocks = _table(len(doc), seed=j)
        for name, layer in zip(NAMES, _kv(len(doc), seed=j).layers):
            write_paged(caches[name], layer.keys, layer.values, slot_mapping(torch.tensor(blocks), 0, len(doc), BS))
        meta = sched.build_connector_meta(_sched_out(req.request_id, doc, blocks))
        assert [(s.req_id, s.segment) for s in meta.saves] == [(req.request_id, True)]
        assert _forward(worker, meta, caches, sched) == set()
        sched.request_finished(req, (blocks,))


def test_a_request_that_stores_a_segment_saves_it_under_the_segment_key_only():
    from kvcodec.blend import SegmentStore

    store = KVStore([MemoryTier(None)], model="m", codec=Raw(), chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    doc = _ids(45, seed=3)
    _store_segments(sched, worker, caches, [doc])
    assert SegmentStore(store).stored_tokens(doc) == 45  # found whatever precedes it in a prompt
    assert store.lookup(doc).num_tokens == 0  # never as a prefix
    assert worker.stats["saved_segments"] == 1


def test_a_request_naming_stored_segments_claims_them_and_its_fused_kv_is_never_saved(caplog):
    """The scheduler claims the segments and hands the worker a fusion; here, without vLLM, the
    worker has no model to recompute with, so the claimed blocks are load errors and vLLM computes them."""
    store = KVStore([MemoryTier(None)], model="m", codec=Raw(), chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    a, b = _ids(40, seed=3), _ids(30, seed=4)
    _store_segments(sched, worker, caches, [a, b])
    question = _ids(5, seed=5)
    ids = b + a + question
    req = _segment_request("fused", ids, segments=[30, 40], share=0.3)
    # whole blocks for a request that asks for its prompt's log-probabilities (vLLM's are garbage after a hit
    # that ends inside a block), to the token for any other
    wants = SimpleNamespace(prompt_logprobs=5)
    assert sched.get_num_new_matched_tokens(_segment_request("other", ids, segments=[30, 40]), 0) == (70, False)
    req.sampling_params = wants
    assert sched.get_num_new_matched_tokens(req, 0) == (70 // BS * BS, False)
    sched.update_state_after_alloc(req, None, 70 // BS * BS)
    blocks = _table(len(ids), seed=9)
    meta = sched.build_connector_meta(_sched_out("fused", ids, blocks, computed=64))
    assert [(l.segments, l.share, l.end, len(l.token_ids)) for l in meta.loads] == [((30, 40), 0.3, 64, 70)]
    assert meta.saves == []
    with caplog.at_level("WARNING"):
        errors = _forward(worker, meta, caches, sched)
    assert errors == set(blocks[:64 // BS]) and "no model to recompute with" in caplog.text
    # the same prompt without segment parameters finds nothing: the fusion saved nothing under its keys
    assert _hit(sched, "plain", ids) == 0


def test_a_prompt_naming_a_segment_still_being_saved_waits_for_it():
    tier = _GatedTier()
    store = KVStore([tier], model="m", codec=Raw(), chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    a, b = _ids(40, seed=3), _ids(30, seed=4)
    tier.gate.set()
    _store_segments(sched, worker, caches, [a])
    tier.gate.clear()
    req = _segment_request("doc-b", b, store_segment=True)  # b's save waits on the tier
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, 0)
    worker.bind_connector_metadata(sched.build_connector_meta(_sched_out("doc-b", b, _table(30, seed=2))))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    ids = b + a + _ids(5, seed=5)
    fused = _segment_request("fused", ids, segments=[30, 40])
    assert sched.get_num_new_matched_tokens(fused, 0) == (None, False)
    only_a = _segment_request("only-a", a + _ids(5, seed=5), segments=[40])
    assert sched.get_num_new_matched_tokens(only_a, 0) == (40, False)  # a is stored: no wait
    tier.gate.set()
    _saves_run(worker, sched, {"doc-b"})
    assert sched.get_num_new_matched_tokens(fused, 0) == (70, False)


@pytest.mark.parametrize("request_kw, why", [
    ({"kv_transfer_params": {"kvcodec": {"segments": [40, 0]}}}, "positive integers"),
    ({"kv_transfer_params": {"kvcodec": {"segments": [40], "share": float("nan")}}}, "0..1"),
    ({"kv_transfer_params": {"kvcodec": {"segments": [40], "store_segment": True}}}, "not both"),
    ({"kv_transfer_params": {"kvcodec": {"segments": [45]}}}, "no token of the prompt"),
    ({"kv_transfer_params": {"kvcodec": {"segments": [40]}}, "cache_salt": "tenant-a"}, "salted"),
    ({"kv_transfer_params": {"kvcodec": {"segments": [40]}}}, "prefix caching is on"),
])
def test_segment_parameters_that_cannot_be_served_are_warned_about_and_ignored(caplog, request_kw, why):
    store = KVStore([MemoryTier(None)], model="m", codec=Raw(), chunk_tokens=CHUNK)
    sched, worker, caches = _pair(store)
    a = _ids(40, seed=3)
    _store_segments(sched, worker, caches, [a])
    if why == "prefix caching is on":  # vLLM would hand the fused blocks to later prompts as computed KV
        config = _config()
        config.cache_config.enable_prefix_caching = True
        sched = KVCodecConnector(config, KVConnectorRole.SCHEDULER, store=store)
    with caplog.at_level("WARNING"):
        assert _hit(sched, "bad", a + _ids(5, seed=5), **request_kw) == 0
    assert why in caplog.text
