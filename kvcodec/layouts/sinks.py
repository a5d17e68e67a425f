"""Where decoded rows go: an engine's memory as a target of token rows, dense (:class:`DenseSink`) or paged
(:class:`PagedSink`).

A sink only holds memory and writes rows into it, ``write(layer, token_start, keys, values)`` with keys and values
``[H, T, D]``; what decodes into it (a store's load, a codec's fused paged decode) lives with the decoder.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.devices import resolve_device
from kvcodec.errors import InvalidInputError
from kvcodec.layouts.paged import PagedLayout, paged_layout, slot_mapping, write_paged


class DenseSink:
    """Keeps each layer's written keys and values as ``[H, T, D]`` tensors on ``device``, in ``dtype`` (None: the
    rows' own); rows may arrive in any token order.  ``rope`` is the rope state of what was written, for
    :meth:`cache`."""

    def __init__(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self.device, self.dtype = resolve_device(device), dtype
        self._parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # per layer: (token, keys, values)
        self.rope: str | None = None

    def write(self, layer: int, token_start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.dtype is not None:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        self._parts.setdefault(layer, []).append((token_start, keys.to(self.device), values.to(self.device)))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values over every token written so far."""
        parts = self._parts.get(i)
        if not parts:
            raise InvalidInputError(f"layer {i} holds nothing")
        if len(parts) > 1:  # joined once, on first use: writes come chunk by chunk, in any order
            parts.sort(key=lambda p: p[0])
            parts[:] = [(parts[0][0], torch.cat([p[1] for p in parts], 1), torch.cat([p[2] for p in parts], 1))]
        return parts[0][1], parts[0][2]

    def cache(self, **meta: Any) -> KVCache:
        """Every layer written, as one cache (``meta`` as for :class:`KVCache`)."""
        return KVCache([self.layer(i) for i in range(len(self._parts))], rope=self.rope, **meta)


class PagedSink:
    """An engine's paged KV memory: one tensor per model layer in ``layout``, and the request's block table
    (``block_ids``, ``block_size`` tokens each).  :meth:`slots` maps the request's tokens to their slots."""

    def __init__(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], block_size: int,
                 layout: PagedLayout | str) -> None:
        self.layers, self.block_size, self.layout = list(layers), int(block_size), paged_layout(layout)
        device = self.layers[0].device if self.layers else torch.device("cpu")
        self.block_table = torch.tensor([int(b) for b in block_ids], dtype=torch.long, device=device)

    @property
    def device(self) -> torch.device | None:
        """Where the memory is (None: no layers)."""
        return self.layers[0].device if self.layers else None

    def slots(self, token_start: int, count: int) -> torch.Tensor:
        """The slots of the request's tokens ``token_start .. token_start+count-1``."""
        return slot_mapping(self.block_table, token_start, count, self.block_size)

    def write(self, layer: int, token_start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        paged = self.layers[layer]
        write_paged(paged, keys.to(paged.device), values.to(paged.device), self.slots(token_start, keys.shape[1]),
                    self.layout)
