"""The Triton lane decoder (``kvcodec/kernels/cachegen.py``'s ``decode_kernel``) and the tables it reads, staged on a
device.  cachegen decodes its parts with it, kvtc its coefficients: the kernel's part table says where each
dequantized element goes, so one launch serves either."""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Sequence

import numpy as np
import torch

from kvcodec.codecs.entropy.tables import STEPS, codebook, cumulative, slot_buckets
from kvcodec.errors import CorruptDataError, InvalidInputError

BLOCK_LANES = 32  # lanes per program on a GPU: one warp, one lane per thread


def kernels() -> ModuleType:
    """``kvcodec.kernels.cachegen``; :class:`InvalidInputError` where triton (the gpu extra) is missing."""
    try:
        from kvcodec.kernels import cachegen
    except ImportError as e:
        raise InvalidInputError(f"cachegen's Triton backend needs triton (pip install 'kvcodec[gpu]'): {e}") from None
    return cachegen


def next_pow2(n: int) -> int:
    """The least power of two at least ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def lane_block(lanes: int) -> int:
    """Lanes per program.  The interpreter runs programs one after another and pays per operation, not
    per lane, so there one program takes every lane."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return min(next_pow2(lanes), 4096)
    return BLOCK_LANES


def to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor of its dtype on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device)


@functools.lru_cache(maxsize=8)
def coding_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Frequencies and left cumulatives, ``[48, 512]`` int32 each, and the slot buckets, on ``device``."""
    cum = cumulative()
    freq = np.zeros_like(cum)
    freq[:, :-1] = codebook()
    return (to_device(freq.astype(np.int32), device), to_device(cum.astype(np.int32), device),
            to_device(slot_buckets(), device))


@functools.lru_cache(maxsize=8)
def steps_on(device: torch.device) -> torch.Tensor:
    """The 256 step values (:data:`~kvcodec.codecs.entropy.tables.STEPS`, float32) on ``device``."""
    return to_device(STEPS, device)


def element_offsets(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's position in elements from the first one's, so one kernel argument reaches them all; tensors
    of another dtype or device, or not a whole number of elements apart, are refused."""
    size = tensors[0].element_size()
    gaps = [t.data_ptr() - tensors[0].data_ptr() for t in tensors]
    if any(t.dtype != tensors[0].dtype or t.device != tensors[0].device for t in tensors) or any(g % size for g in gaps):
        raise InvalidInputError("a Triton launch needs its tensors (keys and values) of one dtype on one device")
    return [g // size for g in gaps]


def dense_destination(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``[H, T, D]`` tensor as a :class:`LaneDecode` destination: one block of ``T`` slots."""
    return x.permute(1, 0, 2).unsqueeze(0), torch.arange(x.shape[1], device=x.device)


class LaneDecode:
    """One launch of the lane decoder with everything it reads staged on the destinations' device: :meth:`run`
    decodes every lane and writes element ``[h, t, d]`` of part ``p``, ``mu + q * step`` in the destinations'
    dtype, to ``view[slots[t] // B, slots[t] % B, h, d]`` of ``destinations[p] = (view, slots)``, ``view`` a
    ``(num_blocks, B, H, D)`` view as :meth:`~kvcodec.layouts.paged.PagedLayout.views` gives a paged layer's keys
    or values (:func:`dense_destination` for a plain tensor), all of one tensor's memory.  A lane that is not a
    valid stream of its symbols raises :class:`CorruptDataError` naming ``what``.  Staging and running are apart
    so a caller can time the kernel alone, or stage while the previous chunk decodes.

    The host arrays are the kernel's (``kvcodec/kernels/cachegen.py``): ``lanes`` ``[NL, 6]``, ``lengths`` (words per
    lane), ``words`` (each lane's words, in lane order), ``order`` (channels in lane order), per part its first
    channel (``channels``) and the offset of its token step codes (``token_codes``, -1: none), and per channel
    of the concatenated parts ``table``, ``mu`` (float16) and ``b_code``, then the token step codes ``a_code``."""

    def __init__(self, what: str, destinations: list[tuple[torch.Tensor, torch.Tensor]], *, lanes: np.ndarray,
                 lengths: np.ndarray, words: list[np.ndarray], order: np.ndarray, channels: Sequence[int],
                 token_codes: Sequence[int], table: np.ndarray, mu: np.ndarray, b_code: np.ndarray,
                 a_code: np.ndarray) -> None:
        self.what, self.num_lanes = what, len(lanes)
        if not self.num_lanes:
            return
        views = [view for view, _ in destinations]
        device = views[0].device
        put = functools.partial(to_device, device=device)
        parts, rows, row = [], [], 0
        for (view, slots), base, chan, a_base in zip(destinations, element_offsets(views), channels, token_codes):
            slots = slots.to(device=device, dtype=torch.int64)
            rows.append(slots // view.shape[1] * view.stride(0) + slots % view.shape[1] * view.stride(1))
            parts.append((base, view.stride(2), row, chan, len(slots), view.shape[3], a_base, view.stride(3)))
            row += len(slots)
        all_words = np.concatenate(words + [np.zeros(1, "<u4")]).astype(np.uint32)  # never empty
        self.status = torch.zeros(self.num_lanes, dtype=torch.int32, device=device)
        self.block = lane_block(self.num_lanes)
        self.args = (put(all_words), put(lanes.astype(np.int64)), put(lengths.astype(np.int64)),
                     put(np.array(parts, np.int64)), put(order.astype(np.int32)), put(table.astype(np.uint8)),
                     *coding_tables(device)[1:], put(mu.astype(np.float16)), put(b_code.astype(np.uint8)),
                     put(a_code.astype(np.uint8)), steps_on(device), torch.cat(rows), views[0], self.status,
                     self.num_lanes, int((lanes[:, 2] * lanes[:, 4]).max()))

    def run(self) -> None:
        if not self.num_lanes:
            return
        kernels().decode_kernel[(-(-self.num_lanes // self.block),)](*self.args, BLOCK_L=self.block, num_warps=1)
        if bool(self.status.any()):
            raise CorruptDataError(f"a {self.what} lane is not a valid ANS stream of its symbols")
