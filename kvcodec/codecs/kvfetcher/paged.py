"""Frame-wise restoration of ``kvfetcher`` sections straight into vLLM-style paged KV memory."""

from __future__ import annotations

from typing import Iterable

import torch

from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.kvfetcher.codec import restore_on
from kvcodec.errors import InvalidInputError
from kvcodec.layouts.paged import check_paged_layer, slot_mapping


def scatter_frames(data: bytes, ctx: LayerContext, paged: torch.Tensor, slots: torch.Tensor,
                   pieces: Iterable[bytes] | None = None) -> int:
    """Decode one section frame by frame into ``paged`` (one layer, ``(2, num_blocks, block_size, H, D)``):
    token ``i`` of the section goes to flat slot ``slots[i]``.  Each frame is dequantized and scattered as soon as
    it is decoded, then dropped.  Returns the peak bytes of decoded frame data held at once."""
    slots = check_paged_layer(paged, ctx.shape, slots)
    flat = paged.view(2, -1, *paged.shape[3:])
    peak = 0

    def sink(lo: int, hi: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        nonlocal peak
        x = k if k is not None else v
        peak = max(peak, x.numel() * x.element_size())
        flat[0 if k is not None else 1, slots[lo:hi]] = x.transpose(0, 1).to(paged.device, paged.dtype)

    restore_on(data, ctx, sink, pieces)
    return peak


def restore_paged(data: bytes, ctx: LayerContext, paged: torch.Tensor, block_table: torch.Tensor,
                  token_start: int | None = None, pieces: Iterable[bytes] | None = None) -> int:
    """:func:`scatter_frames` through a block table: token ``i`` of the section goes to sequence position
    ``token_start + i`` (default ``ctx.token_start``), whose slot comes from ``block_table``."""
    start = ctx.token_start if token_start is None else token_start
    if paged.dim() != 5:
        raise InvalidInputError(f"paged tensor {tuple(paged.shape)} is not (2, num_blocks, block_size, H, D)")
    return scatter_frames(data, ctx, paged, slot_mapping(block_table, start, ctx.shape.tokens, paged.shape[2]), pieces)


__all__ = ["restore_paged", "scatter_frames"]
