"""Measuring a cachegen/kvfetcher importance profile (:mod:`kvcodec.profiles`) by running a model: tooling, as the
profile it writes is all an encoder needs."""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.errors import InvalidInputError
from kvcodec.profiles import Profile, model_signature


@torch.no_grad()
def compute_profile(loaded: Any, token_ids: list[int]) -> Profile:
    """Measure a profile by running a Llama-style model (``self_attn.q_proj`` / ``o_proj``,
    rotate-half RoPE) over ``token_ids``."""
    model = loaded.model
    cfg = model.config
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // nq
    layers = model.model.layers
    if not all(hasattr(l, "self_attn") and hasattr(l.self_attn, "q_proj") for l in layers):
        raise InvalidInputError("computing a profile needs a Llama-style model (self_attn.q_proj, o_proj)")
    queries: dict[int, torch.Tensor] = {}
    hooks = [l.self_attn.q_proj.register_forward_hook(lambda m, i, o, idx=idx: queries.__setitem__(idx, o[0].float()))
             for idx, l in enumerate(layers)]
    try:
        model(torch.tensor([token_ids]))
    finally:
        for h in hooks:
            h.remove()
    key_weight, value_weight = [], []
    for idx, layer in enumerate(layers):
        energy = queries[idx].reshape(-1, nq, d).pow(2).mean(0).reshape(nkv, nq // nkv, d).sum(1)
        pair = (energy[:, : d // 2] + energy[:, d // 2:]) / 2
        key_weight.append(torch.cat([pair, pair], -1).sqrt())
        wo = layer.self_attn.o_proj.weight.float()
        value_weight.append(wo.pow(2).sum(0).reshape(nkv, nq // nkv, d).sum(1).sqrt())
    return Profile(loaded.model_id, key_weight, value_weight, model_signature(cfg))
