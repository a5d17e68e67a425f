"""kvtc's decode on the device (``backend="triton"``, and ``"auto"`` for CUDA tensors): lanes through cachegen's
Triton lane decoder, the inverse transform as one matrix product per group and part, RoPE and the sink tokens on
the device, into contiguous tensors or straight into paged memory.

Lanes.  kvtc's lanes are cachegen's format over the live components (spec/kvtc.md), so cachegen's
``decode_kernel`` reads them unchanged: the kernel sees each part (keys or values of a group) as one head of
``span`` channels (the components up to the last live one), mean 0, each channel's step the component's step and
no token scales, and writes ``0 + q * STEP[code]`` (binary64, then float32: the exact product rounded once, the
float32 product the CPU path takes) into a zeroed ``[T, span]`` float32 matrix.  Dead components, which no lane
codes, stay zero.  One launch covers every part of the frame.

Transform.  ``coefficients @ basis_rows / weight + mean`` in float32 (``KVTC.features``, the CPU path's own
function) over the columns of the wanted layers, with the calibration's coded basis rows, means and weights kept
on the device between chunks.  The sums run in the device's order, so the result is within spec/kvtc.md's
decoding tolerance of the CPU decode, not bit-equal to it.

RoPE.  ``Rotary.rotate`` (binary64, angles from float64 on the host) on the keys of every layer of a group that
shares a rotary setting and positions, in one call.  The sink tokens are written as stored (float16).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.cachegen.device import _coding_tables, _kernels, _lane_block, _put, _steps
from kvcodec.errors import CorruptDataError
from kvcodec.layouts.paged import paged_layout, scatter_rows, write_paged

if TYPE_CHECKING:
    from kvcodec.codecs.kvtc.codec import KVTC, CodedPart

# Calibrations whose bases stay on a device between chunks (per device): a server decodes one model's chunks.
MAX_CALIBRATIONS = 2


class CoefficientLaunch:
    """One launch of the lane decoder over ``parts``, staged on ``device``: :meth:`run` fills
    :attr:`coefficients` (``[T, span]`` float32 per part) and raises :class:`CorruptDataError` for a lane that is
    not a valid stream.  Staging and running are apart so a benchmark can time the kernel alone."""

    def __init__(self, codec: KVTC, parts: list[CodedPart], device: torch.device) -> None:
        spans = np.array([p.span for p in parts], np.int64)
        tokens = np.array([p.tokens for p in parts], np.int64)
        sizes = spans * tokens
        out_at = np.concatenate([[0], np.cumsum(sizes)])
        self.out = torch.empty(max(int(out_at[-1]), 1), dtype=torch.float32, device=device)
        self.coefficients = [self.out[int(o):int(o) + int(n)].view(int(t), int(s))
                             for o, n, t, s in zip(out_at, sizes, tokens, spans)]
        chan = np.concatenate([[0], np.cumsum(spans)])
        row_at = np.concatenate([[0], np.cumsum(tokens)])
        lc, lt = codec.lane_components, codec.lane_tokens
        orders, lanes, order_at = [], [], 0
        for i, p in enumerate(parts):
            live = p.live
            # within each block of lane_components live components, by table, ties in component order (_plan's runs)
            orders.append(live[np.lexsort((p.table[live], np.arange(len(live)) // lc))] + chan[i])
            blocks, steps = -(-len(live) // lc), -(-p.tokens // lt)
            k = np.arange(blocks * steps)
            c0, t0 = k // steps * lc, k % steps * lt
            lanes.append(np.stack([np.full(len(k), i), order_at + c0, np.minimum(lc, len(live) - c0), t0,
                                   np.minimum(lt, p.tokens - t0), np.zeros(len(k), np.int64)], 1))
            order_at += len(live)
        lane_table = np.concatenate(lanes).astype(np.int64).reshape(-1, 6) if lanes else np.zeros((0, 6), np.int64)
        lengths = np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, np.int64)
        lane_table[1:, 5] = np.cumsum(lengths)[:-1]
        self.num_lanes = len(lane_table)
        if not self.num_lanes:
            return
        put = lambda arr: _put(arr, device)  # noqa: E731
        part_rows = np.stack([out_at[:-1], np.zeros_like(spans), row_at[:-1], chan[:-1], tokens, spans,
                              np.full_like(spans, -1), np.ones_like(spans)], 1)
        rows = np.concatenate([np.arange(t) * s for t, s in zip(tokens, spans)])
        words = np.concatenate([p.words for p in parts] + [np.zeros(1, "<u4")]).astype(np.uint32)  # never empty
        self.status = torch.zeros(self.num_lanes, dtype=torch.int32, device=device)
        self.block = _lane_block(self.num_lanes)
        self.args = (put(words), put(lane_table), put(lengths), put(part_rows.astype(np.int64)),
                     put(np.concatenate(orders).astype(np.int32)),
                     put(np.concatenate([p.table[:s] for p, s in zip(parts, spans)] + [np.zeros(1, np.uint8)])),
                     *_coding_tables(device)[1:], put(np.zeros(int(chan[-1]) + 1, np.float16)),
                     put(np.concatenate([p.codes[:s].astype(np.uint8) for p, s in zip(parts, spans)]
                                        + [np.zeros(1, np.uint8)])),
                     put(np.zeros(1, np.uint8)), _steps(device), put(rows.astype(np.int64)), self.out, self.status,
                     self.num_lanes, int((lane_table[:, 2] * lane_table[:, 4]).max()))

    def run(self) -> None:
        self.out.zero_()  # dead components: no lane writes them
        if not self.num_lanes:
            return
        _kernels().decode_kernel[(-(-self.num_lanes // self.block),)](*self.args, BLOCK_L=self.block, num_warps=1)
        if bool(self.status.any()):
            raise CorruptDataError("a kvtc lane is not a valid ANS stream of its symbols")


class _Bases:
    """The coded basis rows (float32), means and weights of each group and part, kept on their device."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: OrderedDict[tuple[str, str], dict[tuple[int, int, int], tuple[torch.Tensor, ...]]] = OrderedDict()

    def get(self, codec: KVTC, g: int, side: int, coded: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        gb = (codec.calibration_data().keys, codec.calibration_data().values)[side][g]
        if device.type == "cpu":
            return gb.rows32[:coded], gb.mean, gb.weight
        with self.lock:
            key = (codec.calibration, str(device))
            held = self.held.setdefault(key, {})
            self.held.move_to_end(key)
            while len(self.held) > MAX_CALIBRATIONS:
                self.held.popitem(last=False)
            if (g, side, coded) not in held:
                held[(g, side, coded)] = tuple(x.to(device) for x in (gb.rows32[:coded], gb.mean, gb.weight))
            return held[(g, side, coded)]


BASES = _Bases()


class ContiguousSink:
    """Decoded layers as fresh ``[H, T, D]`` tensors of the context's dtype on its device."""

    def __init__(self) -> None:
        self.out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def device(self, ctx: LayerContext) -> torch.device:
        return ctx.device

    def put(self, ctx: LayerContext, sinks: tuple[torch.Tensor, torch.Tensor],
            rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        pair = []
        for sink, x, d in zip(sinks, rows, (ctx.shape.key_dim, ctx.shape.value_dim)):
            out = torch.empty(ctx.shape.heads, ctx.shape.tokens, d, dtype=ctx.dtype, device=ctx.device)
            s = sink.shape[1]
            out[:, :s] = sink
            out[:, s:] = x.transpose(0, 1)  # the copy rounds float32 to the dtype as the CPU path's .to() does
            pair.append(out)
        self.out[ctx.layer] = (pair[0], pair[1])


class PagedSink:
    """Decoded layers written into one paged tensor each (``paged[layer]``), token ``t`` at ``slots[layer][t]``."""

    def __init__(self, paged: dict[int, torch.Tensor], slots: dict[int, torch.Tensor], layout: Any) -> None:
        self.paged, self.slots, self.layout = paged, slots, paged_layout(layout)
        self.out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def device(self, ctx: LayerContext) -> torch.device:
        return self.paged[ctx.layer].device

    def put(self, ctx: LayerContext, sinks: tuple[torch.Tensor, torch.Tensor],
            rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        paged, slots = self.paged[ctx.layer], self.slots[ctx.layer]
        s = sinks[0].shape[1]
        if s:
            write_paged(paged, *sinks, slots[:s], self.layout)
        for view, x in zip(self.layout.views(paged), rows):
            scatter_rows(view, slots[s:], x)


def decode_frame(codec: KVTC, blocks: list[tuple[int, list[LayerContext], memoryview]], wanted: set[int],
                 sink: ContiguousSink | PagedSink) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Decode the wanted layers of the groups ``blocks`` (:meth:`KVTC.group_blocks`) into ``sink``; returns its
    decoded tensors (none for a paged sink)."""
    if not blocks:
        return sink.out
    device = sink.device(next(c for _, present, _ in blocks for c in present if c.layer in wanted))
    parsed = [codec.parse_group(g, present, block) for g, present, block in blocks]
    launch = CoefficientLaunch(codec, [p for parts, _, _ in parsed for p in parts], device)
    launch.run()
    coefficients = iter(launch.coefficients)
    exact = _sink_tokens([s for _, sinks, _ in parsed for layer in sinks for s in layer], device)
    for (g, present, _), (parts, _, fine) in zip(blocks, parsed):
        spans, cover = codec.spans(present, wanted)
        coded = [(next(coefficients), part) for part in parts]  # keys, values, then their fine parts
        feats = []
        gains = codec.row_gains(present[0])
        for side in (0, 1):
            rows, mean, weight = BASES.get(codec, g, side, len(parts[side].table), device)
            feats.append(codec.side_features([(coeff, rows[:part.span]) for coeff, part in coded[side::2]], mean,
                                             weight, cover[side], fine, gains))
        layer_rows = {}
        for c in present:
            if c.layer in wanted:
                layer_rows[c.layer] = tuple(f[:, span.start - at:span.stop - at].reshape(f.shape[0], c.shape.heads, d)
                                            for (f, at), span, d in zip(feats, spans[c.layer],
                                                                        (c.shape.key_dim, c.shape.value_dim)))
        _rotate(codec, [c for c in present if c.layer in wanted], layer_rows)
        for c in present:
            pair = (next(exact), next(exact))
            if c.layer in wanted:
                sink.put(c, pair, layer_rows[c.layer])
    return sink.out


def _sink_tokens(arrays: list[np.ndarray], device: torch.device) -> Iterator[torch.Tensor]:
    """The frame's exact sink tokens (float16 ``[H, S, D]`` arrays) on ``device`` as float32, in one copy."""
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays] + [np.zeros(0, "<f2")]).astype(np.float16))
    flat = flat.to(device).float()
    at = 0
    for a in arrays:
        yield flat[at:at + a.size].view(a.shape)
        at += a.size


def _rotate(codec: KVTC, layers: list[LayerContext], rows: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put the rotary embedding back on the keys (``[T, H, D]``) of ``layers``, one call per shared setting."""
    cal = codec.calibration_data()
    batches: dict[tuple, list[LayerContext]] = {}
    for c in layers:
        if codec._rotated(c):
            rot = cal.layers[c.layer].rotary
            batches.setdefault((rot.inv_freq.tobytes(), rot.scaling, c.positions[codec._sinks(c):], c.shape.key_dim),
                               []).append(c)
    for batch in batches.values():
        rot = cal.layers[batch[0].layer].rotary
        keys = torch.cat([rows[c.layer][0] for c in batch], 1)  # [T, heads of the batch, D]
        positions = batch[0].positions_tensor()[codec._sinks(batch[0]):]
        turned = rot.rotate(keys.transpose(0, 1), positions).transpose(0, 1)
        at = 0
        for c in batch:
            rows[c.layer] = (turned[:, at:at + c.shape.heads], rows[c.layer][1])
            at += c.shape.heads
