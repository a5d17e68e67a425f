"""The vLLM connector's start-up decisions checked against vLLM's own code, without starting an engine: the CPU
attention layout against vLLM's ``cpu_attn_reshape_and_cache`` and layouts it must refuse (the model's profile is
found as every hook finds it: tests/test_store_setup.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from kvcodec.codecs import get_codec
from kvcodec.codecs.base import LayerContext
from kvcodec.engines.vllm_connector.setup import detect_layout
from kvcodec.errors import UnsupportedError
from kvcodec.formats.v1 import LayerShape
from kvcodec.layouts.paged import CPU, read_paged, slot_mapping, write_paged


def _vllm_cpu_cache(isa: str, heads: int, dim: int, block_size: int, num_blocks: int, tokens: int, seed: int):
    """KV written by vLLM's CPU attention kernel itself, with the slots of a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
    value = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
    cache = torch.zeros(num_blocks, heads, block_size, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, dim).chunk(2, dim=2)  # as vLLM splits it
    table = torch.randperm(num_blocks, generator=g)[: -(-tokens // block_size)]
    slots = slot_mapping(table, 0, tokens, block_size)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    return cache, key.transpose(0, 1), value.transpose(0, 1), slots


@pytest.mark.parametrize("isa,dim,block_size", [("vec", 64, 128), ("vec", 128, 32), ("vec16", 48, 16)])
def test_cpu_layout_is_what_vllm_writes(isa, dim, block_size):
    cache, keys, values, slots = _vllm_cpu_cache(isa, 3, dim, block_size, 9, 2 * block_size + 5, seed=dim)
    k, v = read_paged(cache, slots, CPU)
    assert torch.equal(k, keys) and torch.equal(v, values)
    ours = torch.zeros_like(cache)
    write_paged(ours, keys, values, slots, CPU)
    assert torch.equal(ours, cache)


@pytest.mark.parametrize("codec", ["raw", "kvfetcher", "cachegen"])
def test_codec_decodes_straight_into_the_cpu_layout(codec):
    """``Codec.decode_layer_paged`` with the CPU layout puts each token where vLLM's kernel would have."""
    cache, keys, values, slots = _vllm_cpu_cache("vec", 3, 64, 32, 12, 100, seed=1)
    c = get_codec(codec)
    ctx = LayerContext(0, 1, LayerShape(3, 100, 64, 64), torch.bfloat16)
    data = c.encode_layer(keys, values, ctx)
    want_k, want_v = c.decode_layer(data, ctx)
    got = torch.full_like(cache, float("nan"))
    c.decode_layer_paged(data, ctx, got, slots, layout="cpu")
    k, v = read_paged(got, slots, CPU)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    if c.lossless:
        assert torch.equal(k, keys) and torch.equal(v, values)


def _layer(isa: str | None):
    return SimpleNamespace(attn_backend=CPUAttentionBackend, isa=isa)


def _config_with(layers: dict):
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers),
                           model_config=SimpleNamespace(dtype=torch.bfloat16), cache_config=SimpleNamespace(cache_dtype="auto"))


def test_detect_layout_takes_vec_and_refuses_amx(monkeypatch):
    """vLLM's CPU backend class with the kernel set it picked; the layers stand in for vLLM's Attention modules."""
    import vllm.config

    monkeypatch.setattr(vllm.config, "get_layers_from_vllm_config",
                        lambda cfg, cls, names: {n: cfg.compilation_config.static_forward_context[n] for n in names})
    caches = {"model.layers.0.self_attn.attn": torch.zeros(4, 3, 128, 128, dtype=torch.bfloat16)}
    assert detect_layout(_config_with({n: _layer("vec") for n in caches}), caches) is CPU
    # tile-packed keys: never read or written blindly, and the refusal names the dtype that works
    with pytest.raises(UnsupportedError, match="'amx' kernels.*--dtype float16"):
        detect_layout(_config_with({n: _layer("amx") for n in caches}), caches)
    fp8 = {n: t.to(torch.uint8) for n, t in caches.items()}
    with pytest.raises(UnsupportedError, match="uint8"):
        detect_layout(_config_with({n: _layer("vec") for n in fp8}), fp8)
