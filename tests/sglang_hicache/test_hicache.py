"""kvcodec's HiCache storage backend inside SGLang 0.5.23's own classes, on the CPU: made by SGLang's
``StorageBackendFactory`` from the ``dynamic`` config, fed real SmolLM2 KV through SGLang's host pools, and called
by SGLang's own ``HiCacheController`` methods (the hit query, both page-set and both page-get paths) on a namespace
holding what those methods read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

import kvcodec
from kvcodec.cache import KVCache
from kvcodec.engines.sglang_hicache import KVCodecHiCacheStorage
from kvcodec.errors import InvalidInputError, KVCodecError
from kvcodec.tools.harness.sglang_pools import LAYOUTS, PAGE, TOKENS, make_host_pool, read_tokens, write_tokens

DYNAMIC = {"backend_name": "kvcodec", "module_path": "kvcodec.engines.sglang_hicache",
           "class_name": "KVCodecHiCacheStorage"}
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SAVED = torch.arange(PAGE, PAGE + TOKENS)              # host slots of the saved prompt (after SGLang's padding page)
LOADED = torch.arange(PAGE + TOKENS, PAGE + 2 * TOKENS)  # where a prefetch lands


def config(pool, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, model_name: str = MODEL,
           **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=pool.layout == "page_first", model_name=model_name,
                                extra_config={**DYNAMIC, **extra})


def attach(pool, model_name: str = MODEL, **extra) -> KVCodecHiCacheStorage:
    """What SGLang's HiCacheController.attach_storage_backend does: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config(pool, model_name=model_name, **extra), pool)
    backend.register_mem_pool_host(pool)
    return backend


def controller(backend, pool) -> SimpleNamespace:
    """What SGLang's HiCacheController storage methods read of it."""
    return SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool,
                           page_size=pool.page_size)


def save(backend, pool, ids, *, zero_copy: bool) -> bool:
    hashes = get_storage_hash_str(ids, None, page_size=pool.page_size)
    put = HiCacheController._page_set_zero_copy if zero_copy else HiCacheController._generic_page_set
    return put(controller(backend, pool), hashes, SAVED[: len(ids)])


def prefetch(backend, pool, ids, *, zero_copy: bool) -> tuple[int, int]:
    """SGLang's prefetch: the hit query (leading pages stored), then the page reads into the host pool at LOADED.
    Returns (tokens the query found, pages read)."""
    ctl, op = controller(backend, pool), PrefetchOperation("req", ids)
    hashes, tokens = HiCacheController._storage_hit_query(ctl, op)
    get = HiCacheController._page_get_zero_copy if zero_copy else HiCacheController._generic_page_get
    return tokens, get(ctl, op, hashes, LOADED[: len(hashes) * pool.page_size])


def same_bits(a: KVCache, b: KVCache) -> bool:
    return all(torch.equal(x.keys.view(torch.int16), y.keys.view(torch.int16)) and
               torch.equal(x.values.view(torch.int16), y.values.view(torch.int16)) for x, y in zip(a.layers, b.layers))


def test_the_factory_makes_the_backend():
    pool = make_host_pool("layer_first")
    backend = attach(pool, codec="raw")
    assert type(backend) is KVCodecHiCacheStorage and backend.mem_pool_host is pool
    assert backend.store.shape.layers == 30 and backend.store.chunk_tokens == PAGE
    # SGLang's page hashes become keys that name the model and depend on the codec
    key = backend.key("ab" * 32)
    assert key.startswith("kvc@HuggingFaceTB-SmolLM2-135M-Instruct@") and key != attach(pool, codec="cachegen").key("ab" * 32)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["batch_set", "v1"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_raw_pages_come_back_bit_exact_in_another_layout(real_pages, tmp_path, layout, zero_copy):
    """Saved from a host pool of one layout, prefetched by another SGLang instance (same folder) into a pool of the
    next layout: the real KV arrives bit for bit."""
    kv, ids = real_pages
    writer_pool, reader_pool = make_host_pool(layout), make_host_pool(LAYOUTS[(LAYOUTS.index(layout) + 1) % 4])
    write_tokens(writer_pool, SAVED, kv)
    tiers = [f"disk:{tmp_path}"]
    assert save(attach(writer_pool, codec="raw", tiers=tiers), writer_pool, ids, zero_copy=zero_copy)
    reader = attach(reader_pool, codec="raw", tiers=tiers)
    assert prefetch(reader, reader_pool, ids, zero_copy=zero_copy) == (TOKENS, TOKENS // PAGE)
    assert same_bits(read_tokens(reader_pool, LOADED), kv)
    assert reader.stats == {"hits": 8, "misses": 0, "puts": 0}


def test_cachegen_pages_are_its_decode_within_its_error(real_pages):
    kv, ids = real_pages
    pool = make_host_pool("page_first")
    write_tokens(pool, SAVED, kv)
    backend = attach(pool, codec="cachegen", interface_v1=1, model="SmolLM2-135M-Instruct")  # its shipped profile
    assert save(backend, pool, ids, zero_copy=True)
    assert prefetch(backend, pool, ids, zero_copy=True) == (TOKENS, TOKENS // PAGE)
    got = read_tokens(pool, LOADED)
    for p in range(TOKENS // PAGE):  # each page is exactly what kvcodec's own API makes of it
        page = KVCache([(l.keys[:, p * PAGE:(p + 1) * PAGE], l.values[:, p * PAGE:(p + 1) * PAGE]) for l in kv.layers],
                       model="SmolLM2-135M-Instruct")
        direct = kvcodec.decode(kvcodec.encode(page, "cachegen", chunk_tokens=PAGE))
        assert all(torch.equal(g.keys[:, p * PAGE:(p + 1) * PAGE], d.keys) and
                   torch.equal(g.values[:, p * PAGE:(p + 1) * PAGE], d.values) for g, d in zip(got.layers, direct.layers))
    a = torch.cat([torch.cat([l.keys, l.values]) for l in got.layers]).float()
    b = torch.cat([torch.cat([l.keys, l.values]) for l in kv.layers]).float()
    assert (a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt() < 0.25
    assert backend.tiers[0].size() < kv.nbytes / 2.5  # bytes held, container headers included


def test_exists_counts_leading_hits_across_tiers(real_pages, tmp_path):
    kv, ids = real_pages
    pool = make_host_pool("layer_first")
    write_tokens(pool, SAVED, kv)
    backend = attach(pool, codec="raw", tiers=["cpu", f"disk:{tmp_path}"])
    assert save(backend, pool, ids, zero_copy=True)
    hashes = get_storage_hash_str(ids, None, page_size=PAGE)
    memory, disk = backend.tiers
    memory.delete(backend.key(hashes[1]))  # still on disk: a hit
    assert backend.batch_exists(hashes) == 8 and backend.exists(hashes[1])
    for tier in backend.tiers:
        tier.delete(backend.key(hashes[3]))
    assert backend.batch_exists(hashes) == 3 and not backend.exists(hashes[3]) and backend.exists(hashes[4])
    assert backend.batch_exists(hashes[3:]) == 0 and backend.batch_exists([]) == 0
    assert prefetch(backend, pool, ids, zero_copy=False) == (3 * PAGE, 3)
    assert backend.clear() and backend.batch_exists(hashes) == 0


def _damage(kind: str, value: bytes, other: bytes) -> bytes:
    if kind == "flipped bit":
        return value[:5000] + bytes([value[5000] ^ 1]) + value[5001:]
    if kind == "truncated":
        return value[: len(value) // 2]
    if kind == "empty":
        return b""
    if kind == "garbage":
        return bytes(range(256)) * 64
    return other  # "another page's value": intact, but written for another key


@pytest.mark.parametrize("kind", ["flipped bit", "truncated", "empty", "garbage", "another page's value"])
def test_a_bad_value_is_a_miss_and_is_evicted(real_pages, kind):
    kv, ids = real_pages
    pool = make_host_pool("page_first_direct")
    write_tokens(pool, SAVED, kv)
    backend = attach(pool, codec="raw", interface_v1=1)
    assert save(backend, pool, ids, zero_copy=True)
    hashes = get_storage_hash_str(ids, None, page_size=PAGE)
    tier = backend.tiers[0]
    bad_key = backend.key(hashes[2])
    tier.put(bad_key, _damage(kind, tier.get(bad_key), tier.get(backend.key(hashes[5]))))
    assert backend.batch_get_v1(hashes, LOADED) == [True, True] + [False] * 6
    assert not tier.contains(bad_key) and backend.store.stats["corrupt"] == 1
    assert same_bits(read_tokens(pool, LOADED[: 2 * PAGE]), KVCache([(l.keys[:, :2 * PAGE], l.values[:, :2 * PAGE])
                                                                      for l in kv.layers]))
    assert not read_tokens(pool, LOADED[2 * PAGE: 3 * PAGE]).layers[0].keys.any()  # nothing of it was written
    assert backend.get(hashes[2], pool.get_dummy_flat_data_page()) is None


def test_a_page_of_another_shape_is_a_miss(real_pages):
    """A value of the same model name and page hash but of another head count (another deployment's, or forged)
    is refused before it is decoded."""
    kv, ids = real_pages
    pool, other_pool = make_host_pool("layer_first"), make_host_pool("layer_first", heads=2)
    backend, other = attach(pool, codec="raw"), attach(other_pool, codec="raw")
    write_tokens(other_pool, SAVED, KVCache([(l.keys[:2], l.values[:2]) for l in kv.layers]))
    assert save(other, other_pool, ids, zero_copy=True)
    hashes = get_storage_hash_str(ids, None, page_size=PAGE)
    assert backend.key(hashes[0]) == other.key(hashes[0])
    backend.tiers[0].put(backend.key(hashes[0]), other.tiers[0].get(other.key(hashes[0])))
    assert backend.batch_exists(hashes) == 1 and backend.batch_get_v1(hashes[:1], LOADED[:PAGE]) == [False]
    assert backend.store.stats["corrupt"] == 1


def test_a_secret_refuses_values_written_without_it(real_pages, tmp_path, monkeypatch):
    kv, ids = real_pages
    pool = make_host_pool("layer_first")
    write_tokens(pool, SAVED, kv)
    plain = attach(pool, codec="raw", tiers=[f"disk:{tmp_path}"])
    assert save(plain, pool, ids, zero_copy=True)
    monkeypatch.setenv("KVCODEC_STORE_SECRET", "s" * 32)
    sealed = attach(pool, codec="raw", tiers=[f"disk:{tmp_path}"])
    hashes = get_storage_hash_str(ids, None, page_size=PAGE)
    assert sealed.batch_exists(hashes) == 0  # its keys are HMACs: nobody without the secret can name them
    sealed.tiers[0].put(sealed.key(hashes[0]), plain.tiers[0].get(plain.key(hashes[0])))
    assert sealed.batch_get_v1(hashes[:1], LOADED[:PAGE]) == [False]
    assert save(sealed, pool, ids, zero_copy=True) and sealed.batch_get_v1(hashes, LOADED) == [True] * 8


def test_bad_calls_are_misses_not_exceptions(real_pages):
    kv, ids = real_pages
    pool = make_host_pool("layer_first")
    hashes = get_storage_hash_str(ids, None, page_size=PAGE)
    early = StorageBackendFactory.create_backend("dynamic", config(pool, codec="raw"), pool)
    # before SGLang registers its host pool
    assert early.get(hashes[0]) is None and early.batch_exists(hashes) == 0 and not early.exists(hashes[0])
    assert early.batch_set_v1(hashes, SAVED) == [False] * 8 and early.batch_get_v1(hashes, LOADED) == [False] * 8
    backend = attach(pool, codec="raw")
    assert backend.batch_set_v1(hashes, SAVED[:100]) == [False] * 8  # not a whole page per key
    assert backend.batch_get_v1(hashes, None) == [False] * 8
    assert not backend.set(hashes[0], torch.zeros(10, dtype=torch.float16))
    assert not backend.set(hashes[0], pool.get_data_page(PAGE).float())  # another dtype
    assert not backend.batch_set(hashes, [pool.get_data_page(PAGE)])
    assert backend.set(hashes[0], pool.get_data_page(PAGE))
    assert backend.get(hashes[0], torch.zeros(10, dtype=torch.float16)) is None
    assert backend.get(hashes[0]) is not None  # a target of its own


@pytest.mark.parametrize("extra, error", [
    ({"tiers": ["nope://x"]}, "unknown scheme"),
    ({"tiers": "cpu:1GiB", "codec": "kvtc"}, "position"),
    ({"codec": "no-such-codec"}, "no-such-codec"),
    ({"codec_options": [1]}, "codec_options"),
    ({"tiers": []}, "list of tier URLs"),
    ({"tier": ["cpu"]}, "unknown setting"),
    ({"secret": "s" * 32}, "KVCODEC_STORE_SECRET"),
    ({"tiers": ["redis://user:pw@127.0.0.1:6379"]}, "password_file"),
])
def test_bad_settings_stop_start_up_with_a_clear_error(extra, error):
    with pytest.raises(KVCodecError, match=error):
        StorageBackendFactory.create_backend("dynamic", config(make_host_pool("layer_first"), **extra), None)


def test_a_chunk_size_other_than_the_page_is_refused():
    with pytest.raises(InvalidInputError, match="page size"):
        attach(make_host_pool("layer_first"), codec="raw", chunk_tokens=PAGE * 2)


def _checkpoint(folder, weights: bytes) -> str:
    """A model folder: one config, and weight files of these bytes (written in place when it exists)."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30}')
    (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


def test_two_checkpoints_of_one_name_and_config_never_share_pages(real_pages, tmp_path, monkeypatch):
    """The backend's identity had no model digest: a fine-tune served under the base model's name and config, or
    weights replaced in place, loaded the base model's pages.  Its keys now cover the weights' bytes."""
    monkeypatch.setenv("KVCODEC_DIGEST_CACHE", str(tmp_path / "digests.json"))
    kv, ids = real_pages
    pool = make_host_pool("layer_first")
    write_tokens(pool, SAVED, kv)
    hashes = get_storage_hash_str(ids, None, page_size=PAGE)
    tiers = [f"disk:{tmp_path / 'pages'}"]
    folder = _checkpoint(tmp_path / "served", b"base weights")
    base = attach(pool, folder, codec="raw", tiers=tiers)
    assert save(base, pool, ids, zero_copy=True) and base.batch_exists(hashes) == 8
    _checkpoint(tmp_path / "served", b"fine-tuned weights")  # replaced in place: same path, name and config
    tuned = attach(pool, folder, codec="raw", tiers=tiers)
    assert tuned.key(hashes[0]) != base.key(hashes[0])
    assert tuned.batch_exists(hashes) == 0 and prefetch(tuned, pool, ids, zero_copy=True) == (0, 0)
    # two folders under one served name ("model"), told apart by their weights; "model_path" names the folder
    # when SGLang's model name is a served name, not a path
    other = _checkpoint(tmp_path / "other", b"base weights")
    named = attach(pool, "served-name", codec="raw", tiers=tiers, model="SmolLM2", model_path=other)
    renamed = attach(pool, "served-name", codec="raw", tiers=tiers, model="SmolLM2",
                     model_path=_checkpoint(tmp_path / "third", b"other weights"))
    assert named.key(hashes[0]) != renamed.key(hashes[0])


def test_mla_pools_are_refused():
    with pytest.raises(InvalidInputError, match="MLA"):
        StorageBackendFactory.create_backend("dynamic", config(make_host_pool("layer_first"), mla=True), None)


def test_ranks_and_codecs_never_share_keys():
    pool = make_host_pool("layer_first")
    keys = set()
    for codec in ("raw", "cachegen"):
        for rank in (0, 1):
            backend = StorageBackendFactory.create_backend("dynamic", config(pool, tp_rank=rank, tp_size=2, codec=codec),
                                                           None)
            backend.register_mem_pool_host(pool)
            keys.add(backend.key("00" * 32))
    assert len(keys) == 4


@settings(max_examples=12, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_any_page_bits_round_trip_through_raw(layout, dtype, seed):
    """Every bit pattern (NaNs and infinities too) of a page set with SGLang's flat page comes back in get."""
    pool = make_host_pool(layout, dtype=dtype, page_size=16)
    backend = attach(pool, codec="raw")
    bits = torch.randint(-2**15, 2**15, (pool.get_data_page(16).numel(),), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int16)
    assert backend.set("page", bits.view(dtype))
    back = backend.get("page", pool.get_dummy_flat_data_page())
    assert back is not None and torch.equal(back.view(torch.int16), bits)


def test_prefetch_and_backup_threads_at_once(real_pages):
    """SGLang's prefetch thread reads while its backup thread writes, through one backend."""
    from concurrent.futures import ThreadPoolExecutor

    kv, ids = real_pages
    pool = make_host_pool("page_first")
    write_tokens(pool, SAVED, kv)
    backend = attach(pool, codec="raw", tiers=["cpu"])
    first, second = ids[:256], [t + 7 for t in ids[256:]]  # two prompts of 4 pages each
    assert save(backend, pool, first, zero_copy=True)
    hashes_2 = get_storage_hash_str(second, None, page_size=PAGE)
    with ThreadPoolExecutor(2) as workers:
        reads = [workers.submit(prefetch, backend, pool, first, zero_copy=True) for _ in range(3)]
        write = workers.submit(backend.batch_set_v1, hashes_2, SAVED[256:])
        assert [r.result() for r in reads] == [(256, 4)] * 3 and write.result() == [True] * 4
    assert same_bits(read_tokens(pool, LOADED[:256]), KVCache([(l.keys[:, :256], l.values[:, :256]) for l in kv.layers]))
    assert backend.batch_exists(hashes_2) == 4
