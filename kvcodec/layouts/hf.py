"""HuggingFace transformers caches (5.x ``DynamicCache``: ``cache.layers[i].keys``, ``[B, H, T, D]``)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvcodec.errors import InvalidInputError


def hf_pairs(cache: Any, *, batch_index: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Take one sequence of the batch out of a transformers cache, as ``(keys, values)`` per layer
    (:meth:`kvcodec.KVCache.from_hf` makes them a cache).

    Accepts a ``DynamicCache`` (or any object with ``.layers[i].keys/.values``) and
    the legacy tuple-of-``(keys, values)`` form.
    """
    if hasattr(cache, "layers"):
        pairs = [(l.keys, l.values) for l in cache.layers]
    else:
        pairs = [(k, v) for k, v in cache]
    if any(k is None or k.dim() != 4 for k, _ in pairs):
        raise InvalidInputError("every layer of the transformers cache must hold [B, H, T, D] tensors (is it empty?)")
    return [(k[batch_index], v[batch_index]) for k, v in pairs]


def to_hf(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], num_tokens: int, config: Any = None) -> Any:
    """A ``DynamicCache`` holding ``(keys, values)`` per layer, of a ``num_tokens`` sequence, with batch size 1.

    Pass the model's ``config`` so that sliding-window layers get their own layer type.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for i, (keys, values) in enumerate(layers):
        cache.update(keys.unsqueeze(0), values.unsqueeze(0), i)
        # A sliding-window layer holds the last tokens of the sequence but counts every token it has seen: the
        # model takes the next tokens' positions and attention masks from that count (from layer 0, which is a
        # windowed one in Gemma 3), so it must be the whole sequence's, not the window's.
        if hasattr(cache.layers[i], "cumulative_length"):
            cache.layers[i].cumulative_length = num_tokens
    return cache
