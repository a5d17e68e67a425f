"""The cachegen codec's Triton engine: host-side tables and launches of ``kernels/cachegen.py``.

The host keeps what is small and branchy (the step choice, the lane plan) and
the kernels do every pass over the KV itself, the table choice included.  One
launch per pass covers every part (keys or values) of every layer of a chunk.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.cachegen.parts import Part, Side, with_sinks
from kvcodec.codecs.cachegen.tables import NUM_TABLES, STEPS, code_lengths_fixed, codebook, cumulative, slot_buckets
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.formats.v1 import LayerShape
from kvcodec.layouts.paged import FLASH, PagedLayout, check_paged_layer, paged_layout, write_paged

if TYPE_CHECKING:
    from kvcodec.codecs.cachegen.codec import CacheGen

BLOCK_LANES = 32  # lanes per program on a GPU: one warp, one lane per thread
BLOCK_TOKENS = 64


def _lane_block(lanes: int) -> int:
    """Lanes per program.  The interpreter runs programs one after another and pays per operation, not
    per lane, so there one program takes every lane."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return min(_next_pow2(lanes), 4096)
    return BLOCK_LANES


def _kernels():
    try:
        from kvcodec.kernels import cachegen
    except ImportError as e:  # triton is the gpu extra
        raise InvalidInputError(f"cachegen's Triton backend needs triton (pip install 'kvcodec[gpu]'): {e}") from None
    return cachegen


@functools.lru_cache(maxsize=8)
def _coding_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Frequencies and left cumulatives, ``[48, 512]`` int32 each, and the slot buckets, on ``device``."""
    cum = cumulative()
    freq = np.zeros_like(cum)
    freq[:, :-1] = codebook()
    return _put(freq.astype(np.int32), device), _put(cum.astype(np.int32), device), _put(slot_buckets(), device)


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's position in elements from the first one's, so one kernel argument reaches them all."""
    size = tensors[0].element_size()
    gaps = [t.data_ptr() - tensors[0].data_ptr() for t in tensors]
    if any(t.dtype != tensors[0].dtype or t.device != tensors[0].device for t in tensors) or any(g % size for g in gaps):
        raise InvalidInputError("cachegen's Triton path needs keys and values of one dtype on one device")
    return [g // size for g in gaps]


def _lanes(codec: CacheGen, shapes: list[tuple[int, int, int]], sides: list[Side],
           lengths: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The lane table ``[lanes, 6]`` and the channel order of every part (spec/cachegen.md §10.3, group 1), in
    whole-array operations: a chunk of a large model has thousands of lanes and every launch needs this."""
    lc, lt = codec.lane_channels, codec.lane_tokens
    dims = np.array([(h * d, t) for h, t, d in shapes], np.int64).reshape(-1, 2)
    channels, tokens = dims[:, 0], dims[:, 1]
    chan_base = np.concatenate([[0], np.cumsum(channels)[:-1]])
    # order: within each block of lane_channels channels of a part, by table, ties in channel order
    g = np.arange(int(channels.sum()))
    part_of = np.repeat(np.arange(len(shapes)), channels)
    block = np.cumsum(np.concatenate([[0], -(-channels // lc)]))[part_of] + (g - chan_base[part_of]) // lc
    order = np.argsort(block * NUM_TABLES + np.concatenate([s.table for s in sides]), kind="stable")
    # lanes: per part, channel blocks (outer) by token blocks (inner)
    cols, rows_per = -(-channels // lc), -(-tokens // lt)
    count = cols * rows_per
    p = np.repeat(np.arange(len(shapes)), count)
    k = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    c0, t0 = (k // rows_per[p]) * lc, (k % rows_per[p]) * lt
    words = np.zeros(len(k), np.int64)
    if lengths is not None and len(k):
        words[1:] = np.cumsum(np.concatenate(lengths))[:-1]
    table = np.stack([p, chan_base[p] + c0, np.minimum(lc, channels[p] - c0), t0, np.minimum(lt, tokens[p] - t0), words], 1)
    return table.astype(np.int64).reshape(-1, 6), order.astype(np.int32)


def _put(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device)


def _side_arrays(sides: list[Side], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Means (float16), channel step codes and token step codes (uint8), concatenated over parts as the
    section stores them, and each part's offset into the token codes (-1: none)."""
    a, a_base, at = [], [], 0
    for s in sides:
        a_base.append(at if s.a_code is not None else -1)
        if s.a_code is not None:
            a.append(s.a_code)
            at += len(s.a_code)
    return (_put(np.concatenate([s.mu for s in sides]).astype(np.float16), device),
            _put(np.concatenate([s.b_code for s in sides]), device),
            _put(np.concatenate(a) if a else np.zeros(1, np.uint8), device), a_base)


@functools.lru_cache(maxsize=8)
def _steps(device: torch.device) -> torch.Tensor:
    return _put(STEPS, device)


@functools.lru_cache(maxsize=8)
def _code_lengths(device: torch.device) -> torch.Tensor:
    """Code lengths of symbol magnitudes in 1/65536 bit, ``[magnitudes, tables]`` int32."""
    return _put(code_lengths_fixed().astype(np.int32), device)


class TritonEngine:
    """The encoder's passes as Triton kernels over ``(keys, values)`` pairs of tensors (a chunk's layers)."""

    def __init__(self, codec: CacheGen, xs: list[torch.Tensor]) -> None:
        self.codec, self.xs, self.k = codec, xs, _kernels()
        self.device = xs[0].device
        self.shapes = [tuple(x.shape) for x in xs]
        # (keys, values) pairs: the values parts have per-token scales
        self.token_sizes = [h * t if i % 2 else 0 for i, (h, t, _) in enumerate(self.shapes)]
        token_bases = np.cumsum([0, *self.token_sizes])
        chan = 0
        rows = []
        for x, base, a, size in zip(xs, _offsets(xs), token_bases, self.token_sizes):
            h, t, d = x.shape
            rows.append((base, *x.stride(), chan, t, d, int(a) if size else -1, h))
            chan += h * d
        self.channels, self.token_entries = chan, int(token_bases[-1])
        self.parts = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.grid_heads = max(x.shape[0] for x in xs)
        self.block_d = _next_pow2(max(x.shape[2] for x in xs))

    def _by_part(self, per_channel: np.ndarray) -> list[np.ndarray]:
        """A host array over the concatenated channels of all parts, cut into one piece per part."""
        return np.split(per_channel, np.cumsum([h * d for h, _, d in self.shapes])[:-1])

    def stats(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        total = torch.zeros(self.channels, dtype=torch.float64, device=self.device)
        absolute = torch.zeros_like(total)
        tokens = torch.zeros(max(self.token_entries, 1), dtype=torch.float64, device=self.device)
        self.k.stats_kernel[(len(self.xs), self.grid_heads)](self.xs[0], self.parts, total, absolute, tokens,
                                                             BLOCK_T=BLOCK_TOKENS, BLOCK_D=self.block_d)
        out = []
        for part_total, part_absolute, part_tokens, (h, t, _), size in zip(
                self._by_part(total.cpu().numpy()), self._by_part(absolute.cpu().numpy()),
                np.split(tokens.cpu().numpy(), np.cumsum(self.token_sizes)[:-1]), self.shapes, self.token_sizes):
            out.append((part_total, part_absolute, part_tokens.reshape(h, t) if size else None))
        return out

    def symbol_range(self, sides: list[Side]) -> list[tuple[np.ndarray, np.ndarray, None]]:
        mu, b, a, _ = _side_arrays(sides, self.device)
        worst = torch.empty(self.channels, dtype=torch.int32, device=self.device)
        table = torch.empty(self.channels, dtype=torch.uint8, device=self.device)
        grid = (len(self.xs), max(x.shape[0] * x.shape[2] for x in self.xs))
        self.k.range_kernel[grid](self.xs[0], self.parts, mu, b, a, _steps(self.device), _code_lengths(self.device),
                                  worst, table, BLOCK_T=BLOCK_TOKENS)
        return [(w, tab, None) for w, tab in zip(self._by_part(worst.cpu().numpy().astype(np.int64)),
                                                  self._by_part(table.cpu().numpy()))]

    def encode_lanes(self, sides: list[Side]) -> list[tuple[np.ndarray, bytes]]:
        lanes, order = _lanes(self.codec, self.shapes, sides)
        mu, b, a, _ = _side_arrays(sides, self.device)
        table = _put(np.concatenate([s.table for s in sides]), self.device)
        freq, cum, _ = _coding_tables(self.device)
        max_symbols = int((lanes[:, 2] * lanes[:, 4]).max())
        # each symbol costs at most 24 bits and each word carries 32, plus the two flushed words
        capacity = (3 * max_symbols) // 4 + 4
        scratch = torch.empty(len(lanes) * capacity, dtype=torch.uint32, device=self.device)
        nwords = torch.empty(len(lanes), dtype=torch.int64, device=self.device)
        block = _lane_block(len(lanes))
        self.k.encode_kernel[(-(-len(lanes) // block),)](
            self.xs[0], self.parts, _put(lanes, self.device), _put(order, self.device), table, freq, cum, mu, b, a, _steps(self.device),
            scratch, nwords, len(lanes), max_symbols, capacity, BLOCK_L=block, num_warps=1)
        counts = nwords.cpu().numpy()
        if (counts > capacity).any():
            raise InvalidInputError("a cachegen lane overflowed its word budget")  # cannot happen: 24 bits/symbol
        starts = np.concatenate([[0], np.cumsum(counts)])
        words = torch.empty(max(int(starts[-1]), 1), dtype=torch.uint32, device=self.device)
        self.k.compact_kernel[(len(lanes),)](scratch, nwords, _put(starts[:-1], self.device), words,
                                            capacity, BLOCK=256)
        data = words[:int(starts[-1])].cpu().numpy().astype("<u4").tobytes()
        # lanes come part by part: cut the counts and the words at each part's first lane
        cuts = np.cumsum(np.bincount(lanes[:, 0], minlength=len(sides)))[:-1]
        return [(part_counts, data[4 * starts[lo]:4 * starts[lo + len(part_counts)]])
                for lo, part_counts in zip([0, *cuts], np.split(counts, cuts))]

    @staticmethod
    def decode_contiguous(codec: CacheGen, parsed: list[tuple[list[Part], list[np.ndarray]]],
                          ctxs: list[LayerContext]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decode sections into fresh ``[H, T, D]`` tensors (one allocation), every lane in one launch."""
        device, dtype = ctxs[0].device, ctxs[0].dtype
        parts = [p for layer_parts, _ in parsed for p in layer_parts]
        out = torch.empty(sum(h * t * d for h, t, d in (p.shape for p in parts)), dtype=dtype, device=device)
        views, targets, at = [], [], 0
        for p in parts:
            h, t, d = p.shape
            views.append(out[at:at + h * t * d].view(h, t, d))
            targets.append(Target(out, at, t * d, torch.arange(t, device=device) * d))
            at += h * t * d
        _decode(codec, parts, targets)
        sinks = [s for _, layer_sinks in parsed for s in layer_sinks]
        decoded = [with_sinks(v, s) for v, s in zip(views, sinks)]
        return list(zip(decoded[0::2], decoded[1::2]))

    @staticmethod
    def decode_paged(codec: CacheGen, parsed: tuple[list[Part], list[np.ndarray]], paged: torch.Tensor,
                     slots: torch.Tensor, layout: PagedLayout | str = FLASH) -> None:
        """Decode a section into one layer of paged memory of ``layout`` at ``slots``."""
        parts, sinks = parsed
        (h, t, dk), (_, _, dv) = (p.shape for p in parts)
        slots = check_paged_layer(paged, LayerShape(h, t, dk, dv), slots, layout)
        if not paged.is_contiguous():
            raise InvalidInputError("cachegen's Triton path writes into a contiguous paged tensor")
        targets = []
        for view in paged_layout(layout).views(paged):  # keys, values as (num_blocks, block_size, H, D)
            rows = slots // view.shape[1] * view.stride(0) + slots % view.shape[1] * view.stride(1)
            targets.append(Target(paged, view.storage_offset() - paged.storage_offset(), view.stride(2), rows,
                                  view.stride(3)))
        _decode(codec, parts, targets)
        if sinks[0].shape[1]:
            n = sinks[0].shape[1]
            write_paged(paged, *(torch.from_numpy(x.astype(np.float32)).to(paged.device) for x in sinks), slots[:n],
                        layout)


@dataclass
class Target:
    """Where a part's element ``[h, t, d]`` goes: ``tensor``'s element
    ``offset + h * head_stride + d * dim_stride + rows[t]``."""

    tensor: torch.Tensor
    offset: int
    head_stride: int
    rows: torch.Tensor  # int64 [T]
    dim_stride: int = 1


def _decode(codec: CacheGen, parts: list[Part], targets: list[Target]) -> None:
    DecodeLaunch(codec, parts, targets).run()


class DecodeLaunch:
    """One decode launch with everything it reads staged on the device: :meth:`run` decodes ``parts`` into
    ``targets`` and raises :class:`CorruptDataError` for a lane that is not a valid stream.  Staging and
    running are apart so a caller can time the kernel alone, or stage while the previous chunk decodes."""

    def __init__(self, codec: CacheGen, parts: list[Part], targets: list[Target]) -> None:
        device = targets[0].tensor.device
        shapes, sides = [p.shape for p in parts], [p.side for p in parts]
        lanes, order = _lanes(codec, shapes, sides, [p.lengths for p in parts])
        self.num_lanes = len(lanes)
        if not self.num_lanes:
            return
        mu, b, a, a_base = _side_arrays(sides, device)
        bases = _offsets([t.tensor for t in targets])
        part_rows, chan, row = [], 0, 0
        for target, base, (h, t, d), ab in zip(targets, bases, shapes, a_base):
            part_rows.append((base + target.offset, target.head_stride, row, chan, t, d, ab, target.dim_stride))
            chan += h * d
            row += t
        words = np.concatenate([p.words for p in parts] + [np.zeros(1, "<u4")]).astype(np.uint32)  # never empty
        put = lambda arr: _put(arr, device)  # noqa: E731
        self.status = torch.zeros(self.num_lanes, dtype=torch.int32, device=device)
        self.block = _lane_block(self.num_lanes)
        self.args = (put(words), put(lanes), put(np.concatenate([p.lengths for p in parts])),
                     put(np.array(part_rows, np.int64)), put(order),
                     put(np.concatenate([s.table for s in sides])), *_coding_tables(device)[1:],
                     mu, b, a, _steps(device), torch.cat([t.rows.to(device=device, dtype=torch.int64) for t in targets]),
                     targets[0].tensor, self.status, self.num_lanes, int((lanes[:, 2] * lanes[:, 4]).max()))

    def run(self) -> None:
        if not self.num_lanes:
            return
        _kernels().decode_kernel[(-(-self.num_lanes // self.block),)](*self.args, BLOCK_L=self.block, num_warps=1)
        if bool(self.status.any()):
            raise CorruptDataError("a cachegen lane is not a valid ANS stream of its symbols")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
