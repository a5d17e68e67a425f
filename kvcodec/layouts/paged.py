"""vLLM's paged KV layout: per layer ``(2, num_blocks, block_size, H, D)`` and a block table.

Token ``t`` of a sequence lives in slot ``block_table[t // block_size] * block_size
+ t % block_size``.  The slot helpers here are shared by the container decoders
that restore straight into paged memory and by the vLLM connector.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.errors import InvalidInputError
from kvcodec.formats.v1 import LayerShape


def slot_mapping(block_table: torch.Tensor, start: int, count: int, block_size: int) -> torch.Tensor:
    """Flat slot index of tokens ``start .. start+count-1`` of the sequence."""
    t = torch.arange(start, start + count, device=block_table.device)
    if count and (start + count - 1) // block_size >= block_table.numel():
        raise InvalidInputError(f"block table of {block_table.numel()} blocks is too short for token {start + count - 1}")
    return block_table.long()[t // block_size] * block_size + t % block_size


def check_paged_layer(paged: torch.Tensor, shape: LayerShape, slots: torch.Tensor) -> torch.Tensor:
    """``slots`` as int64 on ``paged``'s device, once ``paged`` is checked to be one layer
    ``(2, num_blocks, block_size, H, D)`` for a section of ``shape`` (keys and values of one width) and
    ``slots`` to hold one slot inside it per token of the section."""
    if (paged.dim() != 5 or paged.shape[0] != 2 or tuple(paged.shape[3:]) != (shape.heads, shape.key_dim)
            or shape.key_dim != shape.value_dim):
        raise InvalidInputError(f"paged tensor {tuple(paged.shape)} does not fit a layer of {shape}")
    slots = slots.to(device=paged.device, dtype=torch.int64)
    if slots.shape != (shape.tokens,):
        raise InvalidInputError(f"{tuple(slots.shape)} slots for a section of {shape.tokens} tokens")
    if shape.tokens and not (0 <= int(slots.min()) and int(slots.max()) < paged.shape[1] * paged.shape[2]):
        raise InvalidInputError("slots point outside the paged tensor")
    return slots


def write_paged(paged: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter ``[H, T, D]`` keys and values into one layer's paged tensor at ``slots``."""
    flat = paged.view(2, -1, *paged.shape[3:])
    flat[0, slots] = keys.transpose(0, 1).to(paged.dtype)
    flat[1, slots] = values.transpose(0, 1).to(paged.dtype)


def read_paged(paged: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``[H, T, D]`` keys and values of ``slots`` from one layer's paged tensor."""
    flat = paged.view(2, -1, *paged.shape[3:])
    return flat[0, slots].transpose(0, 1).contiguous(), flat[1, slots].transpose(0, 1).contiguous()


def to_paged(kv: KVCache, *, block_size: int = 16, num_blocks: int | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Lay ``kv`` out in fresh paged tensors, using blocks ``0 .. n-1`` in order.

    Every layer must have the same shape (paged memory is uniform across layers).
    """
    shapes = set(kv.shapes)
    if len(shapes) != 1:
        raise InvalidInputError("the paged layout needs every layer to have the same shape")
    (shape,) = shapes
    if shape.key_dim != shape.value_dim:
        raise InvalidInputError("the paged layout needs keys and values of the same head_dim")
    needed = math.ceil(shape.tokens / block_size)
    num_blocks = needed if num_blocks is None else num_blocks
    if num_blocks < needed:
        raise InvalidInputError(f"{shape.tokens} tokens need {needed} blocks of {block_size}, only {num_blocks} given")
    block_table = torch.arange(needed, dtype=torch.int32, device=kv.device)
    slots = slot_mapping(block_table, 0, shape.tokens, block_size)
    out = []
    for layer in kv.layers:
        paged = torch.zeros(2, num_blocks, block_size, shape.heads, shape.key_dim, dtype=kv.dtype, device=kv.device)
        write_paged(paged, layer.keys, layer.values, slots)
        out.append(paged)
    return out, block_table


def from_paged(kv_caches: Sequence[torch.Tensor], block_table: torch.Tensor, num_tokens: int, **meta: Any) -> KVCache:
    """Gather one sequence of ``num_tokens`` tokens out of per-layer paged tensors."""
    if not kv_caches:
        raise InvalidInputError("no paged layers given")
    layers = []
    for i, paged in enumerate(kv_caches):
        if paged.dim() != 5 or paged.shape[0] != 2:
            raise InvalidInputError(f"layer {i}: paged tensor must be (2, num_blocks, block_size, H, D), got {tuple(paged.shape)}")
        slots = slot_mapping(block_table, 0, num_tokens, paged.shape[2])
        if num_tokens and int(slots.max()) >= paged.shape[1] * paged.shape[2]:
            raise InvalidInputError(f"layer {i}: block table points past the {paged.shape[1]} blocks")
        layers.append(read_paged(paged, slots))
    return KVCache(layers, **meta)
