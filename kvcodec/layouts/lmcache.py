"""LMCache's chunk layout: one tensor ``[2, L, T, H*D]`` (keys then values)."""

from __future__ import annotations

from typing import Sequence

import torch

from kvcodec.errors import InvalidInputError


def to_lmcache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Stack ``(keys, values)`` per layer as ``[2, L, T, H*D]``; every layer must have the same shape."""
    if len({(tuple(k.shape), tuple(v.shape)) for k, v in layers}) != 1:
        raise InvalidInputError("LMCache's layout needs every layer to have the same shape")
    if layers[0][0].shape[2] != layers[0][1].shape[2]:
        raise InvalidInputError("LMCache's layout needs keys and values of the same head_dim")
    def flat(x: torch.Tensor) -> torch.Tensor:
        h, t, d = x.shape
        return x.transpose(0, 1).reshape(t, h * d)
    return torch.stack([torch.stack([flat(k) for k, _ in layers]), torch.stack([flat(v) for _, v in layers])])


def lmcache_pairs(chunk: torch.Tensor, num_heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split ``[2, L, T, H*D]`` back into ``(keys, values)`` layers of ``[H, T, D]``."""
    if num_heads < 1 or chunk.dim() != 4 or chunk.shape[0] != 2 or chunk.shape[3] % num_heads:
        raise InvalidInputError(f"expected [2, L, T, H*D] with H={num_heads}, got {tuple(chunk.shape)}")
    _, layers, t, hd = chunk.shape
    def unflat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(t, num_heads, hd // num_heads).transpose(0, 1).contiguous()
    return [(unflat(chunk[0, i]), unflat(chunk[1, i])) for i in range(layers)]
