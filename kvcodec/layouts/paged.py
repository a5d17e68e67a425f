"""vLLM's paged KV layouts (:class:`PagedLayout`: its GPU backends' and its CPU backend's) and a block table.

Token ``t`` of a sequence lives in slot ``block_table[t // block_size] * block_size
+ t % block_size``.  The slot helpers here are shared by the container decoders
that restore straight into paged memory and by the vLLM connector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from kvcodec.errors import InvalidInputError
from kvcodec.formats.v1 import LayerShape


def slot_mapping(block_table: torch.Tensor, start: int, count: int, block_size: int) -> torch.Tensor:
    """Flat slot index of tokens ``start .. start+count-1`` of the sequence."""
    t = torch.arange(start, start + count, device=block_table.device)
    if count and (start + count - 1) // block_size >= block_table.numel():
        raise InvalidInputError(f"block table of {block_table.numel()} blocks is too short for token {start + count - 1}")
    return block_table.long()[t // block_size] * block_size + t % block_size


@dataclass(frozen=True)
class PagedLayout:
    """How an engine's paged KV memory holds one layer: which tensor shape, and where token ``t``'s key and value
    of head ``h``, channel ``d`` sit in it.  :meth:`views` turns a layer into keys and values viewed as
    ``(num_blocks, block_size, H, D)`` (sharing its memory), which is all the readers and writers here need.

    - :data:`FLASH` (``"flash"``): ``(2, num_blocks, block_size, H, D)``, keys then values (vLLM's GPU backends
      before its KV layouts became ``[L, B, H, N, C]`` stride orders).
    - :data:`GPU` (``"gpu"``): ``(num_blocks, H, block_size, 2 * D)`` in any stride order, the keys in
      ``[..., :D]`` and the values in ``[..., D:]`` (vLLM 0.2x/0.3x FlashAttention, FlashInfer, Triton and Flex
      attention: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``).
    - :data:`CPU` (``"cpu"``): ``(num_blocks, H, block_size, 2 * D)``, contiguous: per block and head, the keys
      transposed as ``[D, block_size]``, then the values as ``[block_size, D]`` (vLLM's CPU attention with its
      ``vec`` and ``vec16`` kernels, written by ``cpu_attn_reshape_and_cache``).
    """

    name: str

    def geometry(self, paged: torch.Tensor) -> tuple[int, int, int, int]:
        """``(num_blocks, block_size, H, D)`` of one layer; a tensor that cannot be this layout is an error."""
        if self.name == "flash" and paged.dim() == 5 and paged.shape[0] == 2:
            return tuple(paged.shape[1:])  # type: ignore[return-value]
        if self.name in ("cpu", "gpu") and paged.dim() == 4 and paged.shape[3] % 2 == 0:
            num_blocks, heads, block_size, two_d = paged.shape
            return num_blocks, block_size, heads, two_d // 2
        raise InvalidInputError(f"a {tuple(paged.shape)} tensor is not a layer of the {self.name!r} paged layout "
                                f"({self.shape_doc})")

    @property
    def shape_doc(self) -> str:
        return "(2, num_blocks, block_size, H, D)" if self.name == "flash" else "(num_blocks, H, block_size, 2*D)"

    def views(self, paged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as ``(num_blocks, block_size, H, D)`` views of ``paged``."""
        num_blocks, block_size, heads, dim = self.geometry(paged)
        if self.name == "flash":
            return paged[0], paged[1]
        if self.name == "gpu":
            return paged.transpose(1, 2).split(dim, dim=-1)  # type: ignore[return-value]
        if not paged.is_contiguous():
            raise InvalidInputError("a layer of the 'cpu' paged layout must be contiguous")
        per_head = paged.view(num_blocks, heads, 2 * block_size * dim)
        keys = per_head[..., : block_size * dim].view(num_blocks, heads, dim, block_size).permute(0, 3, 1, 2)
        values = per_head[..., block_size * dim:].view(num_blocks, heads, block_size, dim).permute(0, 2, 1, 3)
        return keys, values


FLASH = PagedLayout("flash")
GPU = PagedLayout("gpu")
CPU = PagedLayout("cpu")
LAYOUTS = {layout.name: layout for layout in (FLASH, GPU, CPU)}


def paged_layout(layout: PagedLayout | str) -> PagedLayout:
    """``layout`` itself, or the known layout of that name."""
    if isinstance(layout, PagedLayout):
        return layout
    if layout not in LAYOUTS:
        raise InvalidInputError(f"unknown paged layout {layout!r}; known: {sorted(LAYOUTS)}")
    return LAYOUTS[layout]


def check_paged_layer(paged: torch.Tensor, shape: LayerShape, slots: torch.Tensor,
                      layout: PagedLayout | str = FLASH) -> torch.Tensor:
    """``slots`` as int64 on ``paged``'s device, once ``paged`` is checked to be one layer of ``layout`` for a
    section of ``shape`` (keys and values of one width) and ``slots`` to hold one slot inside it per token of the
    section."""
    num_blocks, block_size, heads, dim = paged_layout(layout).geometry(paged)
    if (heads, dim) != (shape.heads, shape.key_dim) or shape.key_dim != shape.value_dim:
        raise InvalidInputError(f"paged tensor {tuple(paged.shape)} does not fit a layer of {shape}")
    slots = slots.to(device=paged.device, dtype=torch.int64)
    if slots.shape != (shape.tokens,):
        raise InvalidInputError(f"{tuple(slots.shape)} slots for a section of {shape.tokens} tokens")
    if shape.tokens and not (0 <= int(slots.min()) and int(slots.max()) < num_blocks * block_size):
        raise InvalidInputError("slots point outside the paged tensor")
    return slots


def scatter_rows(view: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows`` (``[T, H, D]``) into a ``(num_blocks, block_size, H, D)`` view at flat ``slots``."""
    block_size = view.shape[1]
    rows = rows.to(view.dtype)
    # A block table maps a sequence to runs of consecutive slots, one per block: a strided copy per run is ~10x
    # faster than indexing every token (measured on the CPU layout's transposed keys), so runs are copied whole.
    n = int(slots.numel())
    if n > 1:
        breaks = torch.nonzero((slots[1:] != slots[:-1] + 1) | (slots[1:] % block_size == 0)).flatten() + 1
        if len(breaks) < n // 8:
            starts = [0, *breaks.tolist()]
            for a, b in zip(starts, [*starts[1:], n]):
                first = int(slots[a])
                block, offset = first // block_size, first % block_size
                view[block, offset:offset + b - a] = rows[a:b]
            return
    view[slots // block_size, slots % block_size] = rows


def write_paged(paged: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                layout: PagedLayout | str = FLASH) -> None:
    """Scatter ``[H, T, D]`` keys and values into one layer's paged tensor at ``slots``; tensors of any other shape
    than the layer's heads and head size, or than one token per slot, are refused (torch would broadcast one
    head into all of them)."""
    key_view, value_view = paged_layout(layout).views(paged)
    want = (key_view.shape[2], int(slots.numel()), key_view.shape[3])
    if tuple(keys.shape) != want or tuple(values.shape) != want:
        raise InvalidInputError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit a paged layer "
                                f"of {want[0]} heads of {want[2]} at {want[1]} slots: [H, T, D] = {want} expected")
    scatter_rows(key_view, slots, keys.transpose(0, 1))
    scatter_rows(value_view, slots, values.transpose(0, 1))


def read_paged(paged: torch.Tensor, slots: torch.Tensor,
               layout: PagedLayout | str = FLASH) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``[H, T, D]`` keys and values of ``slots`` from one layer's paged tensor."""
    key_view, value_view = paged_layout(layout).views(paged)
    block_size = key_view.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    return (key_view[blocks, offsets].transpose(0, 1).contiguous(),
            value_view[blocks, offsets].transpose(0, 1).contiguous())


def to_paged(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], *, block_size: int = 16,
             num_blocks: int | None = None, layout: PagedLayout | str = FLASH) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Lay ``(keys, values)`` per layer out in fresh paged tensors of ``layout``, using blocks ``0 .. n-1`` in order.

    Every layer must have the same shape (paged memory is uniform across layers).
    """
    shapes = {LayerShape(k.shape[0], k.shape[1], k.shape[2], v.shape[2]) for k, v in layers}
    if len(shapes) != 1:
        raise InvalidInputError("the paged layout needs every layer to have the same shape")
    (shape,) = shapes
    if shape.key_dim != shape.value_dim:
        raise InvalidInputError("the paged layout needs keys and values of the same head_dim")
    needed = math.ceil(shape.tokens / block_size)
    num_blocks = needed if num_blocks is None else num_blocks
    if num_blocks < needed:
        raise InvalidInputError(f"{shape.tokens} tokens need {needed} blocks of {block_size}, only {num_blocks} given")
    device, dtype = layers[0][0].device, layers[0][0].dtype
    block_table = torch.arange(needed, dtype=torch.int32, device=device)
    slots = slot_mapping(block_table, 0, shape.tokens, block_size)
    out = []
    for keys, values in layers:
        paged = torch.zeros(empty_shape(layout, num_blocks, block_size, shape.heads, shape.key_dim), dtype=dtype,
                            device=device)
        write_paged(paged, keys, values, slots, layout)
        out.append(paged)
    return out, block_table


def empty_shape(layout: PagedLayout | str, num_blocks: int, block_size: int, heads: int, dim: int) -> tuple[int, ...]:
    """The shape of one layer of ``layout``."""
    if paged_layout(layout) is not FLASH:
        return num_blocks, heads, block_size, 2 * dim
    return 2, num_blocks, block_size, heads, dim


def paged_pairs(kv_caches: Sequence[torch.Tensor], block_table: torch.Tensor, num_tokens: int,
                layout: PagedLayout | str = FLASH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gather one sequence of ``num_tokens`` tokens out of per-layer paged tensors of ``layout``, as
    ``(keys, values)`` per layer."""
    if not kv_caches:
        raise InvalidInputError("no paged layers given")
    layout = paged_layout(layout)
    layers = []
    for i, paged in enumerate(kv_caches):
        num_blocks, block_size, _, _ = layout.geometry(paged)
        slots = slot_mapping(block_table, 0, num_tokens, block_size)
        if num_tokens and int(slots.max()) >= num_blocks * block_size:
            raise InvalidInputError(f"layer {i}: block table points past the {num_blocks} blocks")
        layers.append(read_paged(paged, slots, layout))
    return layers
