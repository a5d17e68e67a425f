"""SGLang's KV pools on the CPU, sized for SmolLM2-135M (30 layers, 3 KV heads of 64), and real KV in and out of
them by token slot (SGLang is imported when a pool is made)."""

from __future__ import annotations

import torch

LAYERS, HEADS, DIM = 30, 3, 64
PAGE = 64
TOKENS = 512
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def make_host_pool(layout: str, *, dtype: torch.dtype = torch.float16, page_size: int = PAGE, heads: int = HEADS):
    """SGLang's host pool of ``layout`` (2048 tokens and SGLang's padding page), from its CPU device pool.  Not
    smaller: SGLang builds per-layer views of a pool's first pages, so it needs more pages than layers."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(size=512, page_size=page_size, dtype=dtype, head_num=heads, head_dim=DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False, start_layer=0,
                              end_layer=LAYERS - 1)
    return MHATokenToKVPoolHost(device._mha_buffer_info(), 4.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=512, start_layer=0, end_layer=LAYERS - 1)


def layer_view(pool, which: int, layer: int) -> torch.Tensor:
    """``[page, token in page, head, dim]`` of one layer's keys (0) or values (1) in the host pool: SGLang's own
    per-layer views (``k_data_refs``/``v_data_refs``, what its transfer kernels use), and for ``page_head``, whose
    pool has none, its buffer's declared dims ``(2, page, head, token, layer, dim)``."""
    ps = pool.page_size
    if pool.layout == "page_head":
        return pool.kv_buffer[which][:, :, :, layer, :].permute(0, 2, 1, 3)
    ref = (pool.k_data_refs if which == 0 else pool.v_data_refs)[layer]
    return ref if pool.layout == "page_first_direct" else ref.view(-1, ps, *ref.shape[1:])


def write_tokens(pool, slots: torch.Tensor, kv) -> None:
    """Put ``kv`` (``[heads, tokens, dim]`` per layer) at host token ``slots``."""
    ps = pool.page_size
    for l, layer in enumerate(kv.layers):
        for which, t in ((0, layer.keys), (1, layer.values)):
            layer_view(pool, which, l)[slots // ps, slots % ps] = t.permute(1, 0, 2).to(pool.dtype)


def read_tokens(pool, slots: torch.Tensor):
    """The KVCache held at host token ``slots``."""
    from kvcodec.cache import KVCache

    ps = pool.page_size
    return KVCache([tuple(layer_view(pool, which, l)[slots // ps, slots % ps].permute(1, 0, 2).clone()
                          for which in (0, 1)) for l in range(pool.layer_num)])
