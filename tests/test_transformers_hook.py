"""The transformers hook on real SmolLM2: save the prompt's KV, continue a request that shares the prefix from
the store, decoding layer by layer behind start_load()/wait_for_layer(i); its store serves only the model's shape
and is keyed by the model's weights."""

from __future__ import annotations

import pytest
import torch
from stand_ins import Pinned

import kvcodec
from kvcodec.cache import KVCache
from kvcodec.codecs.raw import Raw
from kvcodec.codecs.zstd import Zstd
from kvcodec.engines.transformers_hook import (
    LoadError,
    StreamedPrefix,
    TransformersKVHook,
    streamed_cache,
)
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.store import ChunkShape, KVStore, MemoryTier

NEW_TOKENS = 32


@torch.no_grad()
def _in_memory(smollm2, prefix: list[int], rest: list[int], n: int) -> list[int]:
    """Greedy tokens when the prefix's KV never leaves memory: prefill it, then read the rest, then generate."""
    from transformers import DynamicCache

    model = smollm2.model
    cache = DynamicCache(config=model.config)
    model(torch.tensor([prefix]), cache=cache, use_cache=True)
    logits = model(torch.tensor([rest]), cache=cache, use_cache=True).logits[0]
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        out.append(int(model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1].argmax()))
    return out


@pytest.fixture(scope="module")
def prompts(real_kv):
    ids = real_kv.token_ids
    first = ids[:256]                      # one full chunk: this is what the second request shares
    second = ids[:256] + ids[300:340]      # shares exactly the first chunk
    return first, second


def test_raw_continuation_is_identical(smollm2, prompts):
    first, second = prompts
    store = KVStore([MemoryTier(None)], model=smollm2.model_id, codec="raw")
    hook = TransformersKVHook(smollm2, store)
    a = hook.generate(first, max_new_tokens=2)
    assert a.loaded_tokens == 0 and a.saved_chunks == 1
    assert store.lookup(second).num_tokens == 256
    b = hook.generate(second, max_new_tokens=NEW_TOKENS)
    assert b.loaded_tokens == 256 and b.where == ["cpu"] and not b.recomputed
    assert b.tokens == _in_memory(smollm2, second[:256], second[256:], NEW_TOKENS)


def test_a_prompt_stored_whole_is_not_copied_out_to_be_saved_again(smollm2, prompts, monkeypatch):
    """After every first token the hook copied the whole prompt's KV out of the model's cache to save it, and the
    store then wrote nothing where it held every chunk (vLLM's connector did the same inside the forward pass)."""
    first, _ = prompts
    store = KVStore([MemoryTier(None)], model=smollm2.model_id, codec="raw")
    hook = TransformersKVHook(smollm2, store)
    assert hook.generate(first, max_new_tokens=1).saved_chunks == 1
    copies, real = [], KVCache.from_hf
    monkeypatch.setattr(KVCache, "from_hf", lambda *a, **k: copies.append(1) or real(*a, **k))
    assert hook.generate(first, max_new_tokens=1).saved_chunks == 0 and not copies
    assert hook.generate(first + [7], max_new_tokens=1).saved_chunks == 1 and copies  # a new (partial) chunk


def test_layers_arrive_in_order_and_overlap(smollm2, prompts):
    first, _ = prompts
    store = KVStore([MemoryTier(None)], model=smollm2.model_id, codec="raw")
    kv = smollm2.prefill(first)
    store.put(first, kv)
    loader = StreamedPrefix(store, first, 200, kv.num_layers).start_load()
    k, v = loader.wait_for_layer(kv.num_layers - 1)
    assert k.shape == (3, 200, 64) and torch.equal(k, kv.layers[-1].keys[:, :200])
    result = loader.finish()
    assert result.complete and len(result.layer_ready_s) == kv.num_layers
    assert result.layer_ready_s == sorted(result.layer_ready_s)  # decoded in layer order
    cache = streamed_cache(StreamedPrefix(store, first, 200, kv.num_layers), smollm2.model.config)
    assert cache.get_seq_length() == 200  # known before anything is decoded


@pytest.mark.parametrize("fault, evicted", [(CorruptDataError("simulated bad section in layer 7"), True),
                                             (MemoryError("simulated local failure in layer 7"), False)])
def test_failed_load_is_recomputed(smollm2, prompts, monkeypatch, fault, evicted):
    """Either way the request is recomputed; only a chunk that is itself bad is evicted from the shared store."""
    first, second = prompts
    store = KVStore([MemoryTier(None)], model=smollm2.model_id, codec="raw")
    hook = TransformersKVHook(smollm2, store, save=False)
    store.put(first, smollm2.prefill(first))
    real = Raw.decode_layer

    def broken(self, data, ctx):
        if ctx.layer == 7:
            raise fault
        return real(self, data, ctx)

    monkeypatch.setattr(Raw, "decode_layer", broken)
    with pytest.raises(LoadError):
        StreamedPrefix(store, first, 256, 30).start_load().wait_for_layer(7)
    if evicted:
        store.put(first, smollm2.prefill(first))
    out = hook.generate(second, max_new_tokens=4)
    assert out.recomputed and out.loaded_tokens == 0
    assert store.lookup(second).num_tokens == (0 if evicted else 256)
    monkeypatch.undo()
    assert out.tokens == _in_memory(smollm2, second[:256], second[256:], 4)


def _continued(smollm2, kv, n: int, rest: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens continuing from the first ``n`` tokens of ``kv`` with ``rest`` recomputed."""
    from transformers import DynamicCache

    model = smollm2.model
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(kv.layers):
        cache.update(layer.keys[None, :, :n], layer.values[None, :, :n], i)
    with torch.no_grad():
        logits = model(torch.tensor([rest]), cache=cache, use_cache=True).logits[0]
        out = [int(logits[-1].argmax())]
        while len(out) < new_tokens:
            out.append(int(model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1].argmax()))
    return out


class _ReadCounting(MemoryTier):
    def __init__(self) -> None:
        super().__init__(None)
        self.read = set()  # the keys read

    def get(self, key, max_bytes=None):
        self.read.add(key)
        return super().get(key, max_bytes)


@pytest.mark.parametrize("why", ["corrupt chunk", "planner stops"])
def test_a_load_that_ends_short_keeps_what_loaded_and_recomputes_the_rest(smollm2, prompts, why):
    """Four 64-token chunks are stored; the load ends after two (the third is corrupt, or the link crawls after two
    reads and recomputing the rest is sooner): the model continues from the 128 loaded tokens and computes the
    rest."""
    first, second = prompts
    tier = _ReadCounting()
    store = KVStore([tier], model=smollm2.model_id, codec="raw" if why == "corrupt chunk" else ["cachegen", "raw"],
                    chunk_tokens=64)
    hook = TransformersKVHook(smollm2, store, save=False)
    kv = smollm2.prefill(first)
    store.put(first, kv)
    if why == "corrupt chunk":
        key = store.keys_for(first)[2][0]
        value = bytearray(tier.get(key))
        value[len(value) // 2] ^= 1
        tier.put(key, bytes(value))
    else:
        class Dropping(Pinned):  # a fast link for two reads, then a crawl
            def __init__(self) -> None:
                self.samples = (1.0,)

            estimate = property(lambda self: 1e12 if len(tier.read) < 2 else 1.0)

        store.telemetry.link(tier.name).throughput = Dropping()
        # raw copies, cachegen decodes at 1000 tokens/s
        store.telemetry.decode_rate = lambda codec: Pinned(1e6 if codec.codec_id == "raw" else 1e3)
        hook.prefill_tps = 1000.0
    out = hook.generate(second, max_new_tokens=8)
    assert out.loaded_tokens == 128 and not out.recomputed
    assert [c.status for c in out.load.chunks[:3]] == ["loaded", "loaded",
                                                        "missing" if why == "corrupt chunk" else "recompute"]
    # the model continued from what loaded, in whichever variant (the planner's are cachegen: the link crawled)
    loaded = [store.load_chunk(c.key, c.end - c.start) for c in out.load.chunks[:2]]
    kv = KVCache([tuple(torch.cat([getattr(part.layers[i], kind) for part in loaded], 1) for kind in ("keys", "values"))
                  for i in range(len(kv.layers))], model=kv.model)
    assert out.tokens == _continued(smollm2, kv, 128, second[128:], 8)


# a small calibration keeps the test cheap (about a second): 256 tokens, one basis per layer
SMALL_CALIBRATION = {"max_tokens": 256, "segment_tokens": 128, "group_layers": 1}


def test_a_small_value_declaring_a_huge_cache_is_refused_before_decoding_and_recomputed(smollm2, prompts,
                                                                                         monkeypatch):
    """A store made without the engine's shape (as a user makes one for the hook) once decoded any value up to
    256 MiB: a few KB of zstd under a real key, declaring 8 times SmolLM2's chunk, was decoded in full.  The hook
    gives the store the model's shape, so the value is refused before anything is decoded, evicted, and the
    request is recomputed."""
    first, second = prompts
    tier = MemoryTier(None)
    store = KVStore([tier], model=smollm2.model_id, codec="zstd")
    hook = TransformersKVHook(smollm2, store, save=False)
    key = store.keys_for(first)[0][0]
    zeros = torch.zeros(24, 256, 64)  # 24 KV heads where SmolLM2 has 3; one tensor shared by every layer
    huge = KVCache([(zeros, zeros)] * 30, model=smollm2.model_id)
    forged = kvcodec.encode(huge, "zstd", chunk_tokens=256, meta={"store_key": key})
    assert len(forged) < 64 << 10 and huge.nbytes >= 8 * smollm2.prefill(first).nbytes
    tier.put(key, forged)
    decoded = []
    real = Zstd.decode_layer
    monkeypatch.setattr(Zstd, "decode_layer", lambda self, data, ctx: decoded.append(ctx.layer) or real(self, data, ctx))
    out = hook.generate(second, max_new_tokens=4)
    assert not decoded and not tier.contains(key)
    assert out.recomputed and out.loaded_tokens == 0
    assert out.tokens == _in_memory(smollm2, second[:256], second[256:], 4)


def test_the_hook_gives_a_shapeless_store_the_model_shape_and_refuses_another(smollm2):
    store = KVStore([MemoryTier(None)], model=smollm2.model_id, codec="raw")
    TransformersKVHook(smollm2, store, save_dtype=torch.float16)
    assert store.shape == ChunkShape(30, 3, 64, 64, "float16")
    with pytest.raises(InvalidInputError, match="float32"):
        TransformersKVHook(smollm2, store)  # the model saves float32 into a store of float16 chunks


def test_with_store_keys_pages_by_the_weights_not_the_name(smollm2, prompts, tmp_path):
    """Two checkpoints served under one name (a fine-tune with the base model's config, or weights replaced in
    place) never share keys: the hook's store is keyed by the model identity of its weights."""
    from kvcodec.models import model_path
    from kvcodec.store.identity import model_identity

    first, _ = prompts
    default = TransformersKVHook.with_store(smollm2, ["cpu"], codec="raw")
    assert default.store.identity.model_digest == model_identity(model_path("smollm2"))
    assert default.store.identity.kv_dtype == "float32" and default.store.shape.layers == 30
    keys = set()
    for weights in (b"base", b"fine-tune"):
        folder = tmp_path / weights.decode()
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(weights)
        hook = TransformersKVHook.with_store(smollm2, ["cpu"], codec="raw", model_path=str(folder))
        keys.add(hook.store.keys_for(first)[0][0])
    assert len(keys) == 2 and default.store.keys_for(first)[0][0] not in keys


def test_with_store_settings_are_the_store_configuration(smollm2):
    hook = TransformersKVHook.with_store(smollm2, [MemoryTier(None, name="mine")], codec="raw", chunk_tokens=64,
                                        namespace="tenant-a")
    assert [t.name for t in hook.store.tiers] == ["mine"] and hook.store.chunk_tokens == 64
    assert hook.store.identity.namespace == "tenant-a"
    with pytest.raises(InvalidInputError, match="unknown setting"):
        TransformersKVHook.with_store(smollm2, ["cpu"], codec="raw", chunk_size=64)
    with pytest.raises(InvalidInputError, match="secret"):
        TransformersKVHook.with_store(smollm2, ["cpu"], secret="s" * 32)


# a small calibration keeps the test cheap (about a second): 256 tokens, one basis per layer
SMALL_CALIBRATION = {"max_tokens": 256, "segment_tokens": 128, "group_layers": 1}


def test_kvtc_hook_calibrates_on_first_use_and_finds_it_after(smollm2, prompts, tmp_path, monkeypatch, caplog):
    """codec kvtc with calibration 'auto': the first hook calibrates SmolLM2 (logged) and installs it under the
    model's identity, continues a request from kvtc chunks within kvtc's error; a second hook (a new process's
    registry) finds the installed one."""
    from kvcodec.codecs.kvtc import calibration as calmod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(calmod.ENV_PATH, raising=False)
    monkeypatch.setattr(calmod, "_registered", {})
    first, second = prompts
    caplog.set_level("INFO")
    hook = TransformersKVHook.with_store(smollm2, ["cpu"], codec="kvtc", calibration_options=SMALL_CALIBRATION)
    assert "calibrating it now" in caplog.text
    digest = hook.store.codec.calibration
    assert (tmp_path / "kvcodec" / "calibrations" / f"{digest}.kvtc").is_file()
    assert hook.generate(first, max_new_tokens=1).saved_chunks == 1
    stored = kvcodec.decode(hook.store.fetch(first)[0].data)
    exact = smollm2.prefill(first)
    own = kvcodec.decode(kvcodec.encode(exact, hook.store.codec))  # kvtc's own error on this KV
    for a, b, c in zip(stored.layers, exact.layers, own.layers):
        for x, y, z in ((a.keys, b.keys, c.keys), (a.values, b.values, c.values)):
            assert float((x - y).pow(2).mean().sqrt()) <= 1.05 * float((z - y).pow(2).mean().sqrt()) + 1e-3
    b = hook.generate(second, max_new_tokens=NEW_TOKENS)
    # the continuation runs on the loaded kvtc KV (a 256-token calibration's tokens soon part from the exact ones)
    assert b.loaded_tokens == 256 and not b.recomputed and len(b.tokens) == NEW_TOKENS

    caplog.clear()
    monkeypatch.setattr(calmod, "_registered", {})
    again = TransformersKVHook.with_store(smollm2, ["cpu"], codec="kvtc")
    assert f"using the installed calibration {digest}" in caplog.text and "calibrating" not in caplog.text
    assert again.store.codec.calibration == digest
