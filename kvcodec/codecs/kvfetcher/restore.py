"""Restoring ``kvfetcher`` sections frame by frame: through FFmpeg (:func:`.section.restore`) or NVDEC
(:mod:`.nvdec`, which imports PyNvVideoCodec only when used), into a sink or straight into vLLM-style paged KV
memory."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.kvfetcher import nvdec
from kvcodec.codecs.kvfetcher.section import restore
from kvcodec.errors import InvalidInputError
from kvcodec.layouts.paged import FLASH, PagedLayout, check_paged_layer, paged_layout, scatter_rows, slot_mapping


def uses_nvdec(ctx: LayerContext) -> bool:
    return ctx.backend == "nvdec" or (ctx.backend == "auto" and ctx.device.type == "cuda" and nvdec.available())


def restore_on(data: bytes, ctx: LayerContext,
               sink: Callable[[int, int, torch.Tensor | None, torch.Tensor | None], None],
               pieces: Iterable[bytes] | None = None) -> None:
    """:func:`restore` through NVDEC for ``"nvdec"``, or ``"auto"`` onto a CUDA device with PyNvVideoCodec
    installed; else through FFmpeg."""
    if not uses_nvdec(ctx):
        restore(data, ctx, sink, pieces)
        return
    if ctx.device.type != "cuda":
        raise InvalidInputError("kvfetcher's 'nvdec' backend decodes on a CUDA device (pass device='cuda')")
    nvdec.restore_nvdec(data, ctx, sink, pieces, gpu=ctx.device.index or 0)


def scatter_frames(data: bytes, ctx: LayerContext, paged: torch.Tensor, slots: torch.Tensor,
                   pieces: Iterable[bytes] | None = None, layout: PagedLayout | str = FLASH) -> int:
    """Decode one section frame by frame into ``paged`` (one layer of ``layout``, by default
    ``(2, num_blocks, block_size, H, D)``): token ``i`` of the section goes to flat slot ``slots[i]``.  Each frame is
    dequantized and scattered as soon as it is decoded, then dropped.  Returns the peak bytes of decoded frame data
    held at once."""
    slots = check_paged_layer(paged, ctx.shape, slots, layout)
    views = paged_layout(layout).views(paged)
    peak = 0

    def sink(lo: int, hi: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        nonlocal peak
        x = k if k is not None else v
        peak = max(peak, x.numel() * x.element_size())
        scatter_rows(views[0 if k is not None else 1], slots[lo:hi], x.transpose(0, 1).to(paged.device))

    restore_on(data, ctx, sink, pieces)
    return peak


def restore_paged(data: bytes, ctx: LayerContext, paged: torch.Tensor, block_table: torch.Tensor,
                  token_start: int | None = None, pieces: Iterable[bytes] | None = None,
                  layout: PagedLayout | str = FLASH) -> int:
    """:func:`scatter_frames` through a block table: token ``i`` of the section goes to sequence position
    ``token_start + i`` (default ``ctx.token_start``), whose slot comes from ``block_table``."""
    start = ctx.token_start if token_start is None else token_start
    _, block_size, _, _ = paged_layout(layout).geometry(paged)
    return scatter_frames(data, ctx, paged, slot_mapping(block_table, start, ctx.shape.tokens, block_size), pieces,
                          layout)
