"""The transformers hook on real SmolLM2: save the prompt's KV, continue a request that shares the prefix from
the store, decoding layer by layer behind start_load()/wait_for_layer(i)."""

from __future__ import annotations

import pytest
import torch

from kvcodec.engines.transformers_hook import LayerwiseLoader, LoadError, TransformersKVHook, streamed_cache
from kvcodec.store import KVStore, MemoryTier

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


def test_layers_arrive_in_order_and_overlap(smollm2, prompts):
    first, _ = prompts
    store = KVStore([MemoryTier(None)], model=smollm2.model_id, codec="raw")
    kv = smollm2.prefill(first)
    store.put(first, kv)
    loader = LayerwiseLoader(store.fetch(first), 200).start_load()
    k, v = loader.wait_for_layer(kv.num_layers - 1)
    assert k.shape == (3, 200, 64) and torch.equal(k, kv.layers[-1].keys[:, :200])
    loader.join()
    assert loader.layer_ready_s == sorted(loader.layer_ready_s)  # decoded in layer order
    cache = streamed_cache(LayerwiseLoader(store.fetch(first), 200), smollm2.model.config)
    assert cache.get_seq_length() == 200  # known before anything is decoded


def test_failed_load_is_recomputed(smollm2, prompts, monkeypatch):
    first, second = prompts
    store = KVStore([MemoryTier(None)], model=smollm2.model_id, codec="raw")
    hook = TransformersKVHook(smollm2, store, save=False)
    store.put(first, smollm2.prefill(first))
    from kvcodec import reader

    real = reader.Reader.read_chunk

    def broken(self, i, *, layers=None, device=None):
        if layers == [7]:
            raise RuntimeError("simulated decode failure in layer 7")
        return real(self, i, layers=layers, device=device)

    monkeypatch.setattr(reader.Reader, "read_chunk", broken)
    with pytest.raises(LoadError):
        LayerwiseLoader(store.fetch(first)).wait_for_layer(7)
    out = hook.generate(second, max_new_tokens=4)
    assert out.recomputed and out.loaded_tokens == 0
    assert store.lookup(second).num_tokens == 0  # the prefix that failed was evicted
    monkeypatch.undo()
    assert out.tokens == _in_memory(smollm2, second[:256], second[256:], 4)
