"""The cachegen codec's Triton engine: host-side tables and launches of ``kvcodec/kernels/cachegen.py``.

The host keeps what is small and branchy (the step choice, the lane plan) and
the kernels do every pass over the KV itself, the table choice included.  One
launch per pass covers every part (keys or values) of every layer of a chunk.
"""

from __future__ import annotations

import functools
from typing import Protocol

import numpy as np
import torch

from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.cachegen.parts import Part, Side, with_sinks
from kvcodec.codecs.entropy.device import (LaneDecode, coding_tables, dense_destination, element_offsets, kernels,
                                           lane_block, next_pow2, steps_on, to_device)
from kvcodec.codecs.entropy.tables import NUM_TABLES, code_lengths_fixed
from kvcodec.errors import InvalidInputError
from kvcodec.formats.v1 import LayerShape
from kvcodec.layouts.paged import FLASH, PagedLayout, check_paged_layer, paged_layout, write_paged

BLOCK_TOKENS = 64


class LaneGrid(Protocol):
    """What the lane plan takes from the codec: lanes of ``lane_channels`` channels by ``lane_tokens`` tokens."""

    lane_channels: int
    lane_tokens: int


def _lanes(codec: LaneGrid, shapes: list[tuple[int, int, int]], sides: list[Side],
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


def _side_arrays(sides: list[Side]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Means (float16), channel step codes and token step codes (uint8), concatenated over parts as the
    section stores them, and each part's offset into the token codes (-1: none)."""
    a, a_base, at = [], [], 0
    for s in sides:
        a_base.append(at if s.a_code is not None else -1)
        if s.a_code is not None:
            a.append(s.a_code)
            at += len(s.a_code)
    return (np.concatenate([s.mu for s in sides]).astype(np.float16), np.concatenate([s.b_code for s in sides]),
            np.concatenate(a) if a else np.zeros(1, np.uint8), a_base)


def _staged_sides(sides: list[Side], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mu, b, a, _ = _side_arrays(sides)
    return to_device(mu, device), to_device(b, device), to_device(a, device)


@functools.lru_cache(maxsize=8)
def _code_lengths(device: torch.device) -> torch.Tensor:
    """Code lengths of symbol magnitudes in 1/65536 bit, ``[magnitudes, tables]`` int32."""
    return to_device(code_lengths_fixed().astype(np.int32), device)


class TritonEngine:
    """The encoder's passes as Triton kernels over ``(keys, values)`` pairs of tensors (a chunk's layers)."""

    def __init__(self, codec: LaneGrid, xs: list[torch.Tensor]) -> None:
        self.codec, self.xs, self.k = codec, xs, kernels()
        self.device = xs[0].device
        self.shapes = [tuple(x.shape) for x in xs]
        # (keys, values) pairs: the values parts have per-token scales
        self.token_sizes = [h * t if i % 2 else 0 for i, (h, t, _) in enumerate(self.shapes)]
        token_bases = np.cumsum([0, *self.token_sizes])
        chan = 0
        rows = []
        for x, base, a, size in zip(xs, element_offsets(xs), token_bases, self.token_sizes):
            h, t, d = x.shape
            rows.append((base, *x.stride(), chan, t, d, int(a) if size else -1, h))
            chan += h * d
        self.channels, self.token_entries = chan, int(token_bases[-1])
        self.parts = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.grid_heads = max(x.shape[0] for x in xs)
        self.block_d = next_pow2(max(x.shape[2] for x in xs))

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
        mu, b, a = _staged_sides(sides, self.device)
        worst = torch.empty(self.channels, dtype=torch.int32, device=self.device)
        table = torch.empty(self.channels, dtype=torch.uint8, device=self.device)
        grid = (len(self.xs), max(x.shape[0] * x.shape[2] for x in self.xs))
        self.k.range_kernel[grid](self.xs[0], self.parts, mu, b, a, steps_on(self.device), _code_lengths(self.device),
                                  worst, table, BLOCK_T=BLOCK_TOKENS)
        return [(w, tab, None) for w, tab in zip(self._by_part(worst.cpu().numpy().astype(np.int64)),
                                                  self._by_part(table.cpu().numpy()))]

    def encode_lanes(self, sides: list[Side]) -> list[tuple[np.ndarray, bytes]]:
        lanes, order = _lanes(self.codec, self.shapes, sides)
        mu, b, a = _staged_sides(sides, self.device)
        table = to_device(np.concatenate([s.table for s in sides]), self.device)
        freq, cum, _ = coding_tables(self.device)
        max_symbols = int((lanes[:, 2] * lanes[:, 4]).max())
        # each symbol costs at most 24 bits and each word carries 32, plus the two flushed words
        capacity = (3 * max_symbols) // 4 + 4
        scratch = torch.empty(len(lanes) * capacity, dtype=torch.uint32, device=self.device)
        nwords = torch.empty(len(lanes), dtype=torch.int64, device=self.device)
        block = lane_block(len(lanes))
        self.k.encode_kernel[(-(-len(lanes) // block),)](
            self.xs[0], self.parts, to_device(lanes, self.device), to_device(order, self.device), table, freq, cum, mu, b,
            a, steps_on(self.device),
            scratch, nwords, len(lanes), max_symbols, capacity, BLOCK_L=block, num_warps=1)
        counts = nwords.cpu().numpy()
        if (counts > capacity).any():
            raise InvalidInputError("a cachegen lane overflowed its word budget")  # cannot happen: 24 bits/symbol
        starts = np.concatenate([[0], np.cumsum(counts)])
        words = torch.empty(max(int(starts[-1]), 1), dtype=torch.uint32, device=self.device)
        self.k.compact_kernel[(len(lanes),)](scratch, nwords, to_device(starts[:-1], self.device), words,
                                            capacity, BLOCK=256)
        data = words[:int(starts[-1])].cpu().numpy().astype("<u4").tobytes()
        # lanes come part by part: cut the counts and the words at each part's first lane
        cuts = np.cumsum(np.bincount(lanes[:, 0], minlength=len(sides)))[:-1]
        return [(part_counts, data[4 * starts[lo]:4 * starts[lo + len(part_counts)]])
                for lo, part_counts in zip([0, *cuts], np.split(counts, cuts))]

    @staticmethod
    def decode_contiguous(codec: LaneGrid, parsed: list[tuple[list[Part], list[np.ndarray]]],
                          ctxs: list[LayerContext]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decode sections into fresh ``[H, T, D]`` tensors (one allocation), every lane in one launch."""
        device, dtype = ctxs[0].device, ctxs[0].dtype
        parts = [p for layer_parts, _ in parsed for p in layer_parts]
        out = torch.empty(sum(h * t * d for h, t, d in (p.shape for p in parts)), dtype=dtype, device=device)
        views, at = [], 0
        for p in parts:
            h, t, d = p.shape
            views.append(out[at:at + h * t * d].view(h, t, d))
            at += h * t * d
        DecodeLaunch(codec, parts, [dense_destination(v) for v in views]).run()
        sinks = [s for _, layer_sinks in parsed for s in layer_sinks]
        decoded = [with_sinks(v, s) for v, s in zip(views, sinks)]
        return list(zip(decoded[0::2], decoded[1::2]))

    @staticmethod
    def decode_paged(codec: LaneGrid, parsed: tuple[list[Part], list[np.ndarray]], paged: torch.Tensor,
                     slots: torch.Tensor, layout: PagedLayout | str = FLASH) -> None:
        """Decode a section into one layer of paged memory of ``layout`` at ``slots``."""
        parts, sinks = parsed
        (h, t, dk), (_, _, dv) = (p.shape for p in parts)
        slots = check_paged_layer(paged, LayerShape(h, t, dk, dv), slots, layout)
        if not paged.is_contiguous():
            raise InvalidInputError("cachegen's Triton path writes into a contiguous paged tensor")
        # keys, values as (num_blocks, block_size, H, D)
        DecodeLaunch(codec, parts, [(view, slots) for view in paged_layout(layout).views(paged)]).run()
        if sinks[0].shape[1]:
            n = sinks[0].shape[1]
            write_paged(paged, *(torch.from_numpy(x.astype(np.float32)).to(paged.device) for x in sinks), slots[:n],
                        layout)


class DecodeLaunch(LaneDecode):
    """One decode launch of cachegen's ``parts`` into ``destinations`` (one per part, as :class:`LaneDecode`
    takes them), everything it reads staged on their device."""

    def __init__(self, codec: LaneGrid, parts: list[Part], destinations: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        shapes, sides = [p.shape for p in parts], [p.side for p in parts]
        lanes, order = _lanes(codec, shapes, sides, [p.lengths for p in parts])
        mu, b, a, a_base = _side_arrays(sides)
        channels = np.concatenate([[0], np.cumsum([h * d for h, _, d in shapes])[:-1]]).astype(np.int64)
        super().__init__("cachegen", destinations, lanes=lanes, lengths=np.concatenate([p.lengths for p in parts]),
                         words=[p.words for p in parts], order=order, channels=channels.tolist(), token_codes=a_base,
                         table=np.concatenate([s.table for s in sides]), mu=mu, b_code=b, a_code=a)
