"""kvtc's decode on the device (``backend="triton"``, and ``"auto"`` for CUDA tensors): what runs there, the lanes
through the shared Triton lane decoder, the calibration's bases kept on the device, the sink tokens' upload and
RoPE; :meth:`KVTC.decode_frame` drives them.

Lanes.  kvtc's lanes are cachegen's format over the live components (spec/kvtc.md), so the lane decoder
(:class:`~kvcodec.codecs.entropy.device.LaneDecode`) reads them unchanged: it sees each part (keys or values of a
group) as one head of ``span`` channels (the components up to the last live one), mean 0, each channel's step the
component's step and no token scales, and writes ``0 + q * STEP[code]`` (binary64, then float32: the exact product
rounded once, the float32 product the CPU path takes) into a zeroed ``[T, span]`` float32 matrix.  Dead
components, which no lane codes, stay zero.  One launch covers every part of the frame.

Transform.  ``coefficients @ basis_rows / weight + mean`` in float32 (``KVTC.features``, the CPU path's own
function) over the columns of the wanted layers, with the calibration's coded basis rows, means and weights kept
on the device between chunks.  The sums run in the device's order, so the result is within spec/kvtc.md's
decoding tolerance of the CPU decode, not bit-equal to it.

RoPE.  ``Rotary.rotate`` (binary64, angles from float64 on the host) on the keys of every layer that shares a
rotary setting and positions, in one call.  The sink tokens are written as stored (float16).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator, Protocol

import numpy as np
import torch

from kvcodec.codecs.entropy.device import LaneDecode, dense_destination
from kvcodec.codecs.kvtc.calibration import Calibration
from kvcodec.codecs.kvtc.parts import CodedPart
from kvcodec.positions import Rotary

# (calibration, device) pairs whose bases stay on their device between chunks: a server decodes one model's chunks.
MAX_CALIBRATIONS = 2


class ComponentLanes(Protocol):
    """What the lane plan takes from the codec: lanes of ``lane_components`` live components by ``lane_tokens``
    tokens."""

    lane_components: int
    lane_tokens: int


class CoefficientLaunch(LaneDecode):
    """One launch of the lane decoder over ``parts``, staged on ``device``: :meth:`run` fills
    :attr:`coefficients` (``[T, span]`` float32 per part) and raises :class:`CorruptDataError` for a lane that is
    not a valid stream.  Staging and running are apart so a benchmark can time the kernel alone."""

    def __init__(self, codec: ComponentLanes, parts: list[CodedPart], device: torch.device) -> None:
        spans = np.array([p.span for p in parts], np.int64)
        tokens = np.array([p.tokens for p in parts], np.int64)
        sizes = spans * tokens
        out_at = np.concatenate([[0], np.cumsum(sizes)])
        self.out = torch.empty(max(int(out_at[-1]), 1), dtype=torch.float32, device=device)
        self.coefficients = [self.out[int(o):int(o) + int(n)].view(int(t), int(s))
                             for o, n, t, s in zip(out_at, sizes, tokens, spans)]
        chan = np.concatenate([[0], np.cumsum(spans)])
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
        # a part is one head of span channels: its [T, span] matrix as [1, T, span]
        super().__init__("kvtc", [dense_destination(c.unsqueeze(0)) for c in self.coefficients], lanes=lane_table,
                         lengths=lengths, words=[p.words for p in parts],
                         order=np.concatenate(orders) if orders else np.zeros(0, np.int32),
                         channels=chan[:-1].tolist(), token_codes=[-1] * len(parts),
                         table=np.concatenate([p.table[:s] for p, s in zip(parts, spans)] + [np.zeros(1, np.uint8)]),
                         mu=np.zeros(int(chan[-1]) + 1, np.float16),
                         b_code=np.concatenate([p.codes[:s].astype(np.uint8) for p, s in zip(parts, spans)]
                                               + [np.zeros(1, np.uint8)]),
                         a_code=np.zeros(1, np.uint8))

    def run(self) -> None:
        self.out.zero_()  # dead components: no lane writes them
        super().run()


class _Bases:
    """The coded basis rows (float32), means and weights of each group and part, kept on their device."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: OrderedDict[tuple[str, str], dict[tuple[int, int, int], tuple[torch.Tensor, ...]]] = OrderedDict()

    def get(self, cal: Calibration, g: int, side: int, coded: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Group ``g``'s first ``coded`` basis rows, mean and weight of keys (``side`` 0) or values on ``device``."""
        gb = (cal.keys, cal.values)[side][g]
        if device.type == "cpu":
            return gb.rows32[:coded], gb.mean, gb.weight
        with self.lock:
            key = (cal.digest, str(device))
            held = self.held.setdefault(key, {})
            self.held.move_to_end(key)
            while len(self.held) > MAX_CALIBRATIONS:
                self.held.popitem(last=False)
            if (g, side, coded) not in held:
                held[(g, side, coded)] = tuple(x.to(device) for x in (gb.rows32[:coded], gb.mean, gb.weight))
            return held[(g, side, coded)]


BASES = _Bases()


def sink_tokens(arrays: list[np.ndarray], device: torch.device) -> Iterator[torch.Tensor]:
    """The frame's exact sink tokens (float16 ``[H, S, D]`` arrays) on ``device`` as float32, in one copy."""
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays] + [np.zeros(0, "<f2")]).astype(np.float16))
    flat = flat.to(device).float()
    at = 0
    for a in arrays:
        yield flat[at:at + a.size].view(a.shape)
        at += a.size


def rotate(keys: dict[int, torch.Tensor], settings: dict[int, tuple[Rotary, tuple[int, ...]]]) -> dict[int, torch.Tensor]:
    """The keys ``[T, H, D]`` of each layer in ``settings`` rotated to its positions by its rotary setting, one
    call per setting, positions and ``D`` shared by several layers."""
    batches: dict[tuple, list[int]] = {}
    for layer, (rot, positions) in settings.items():
        batches.setdefault((rot.inv_freq.tobytes(), rot.scaling, positions, keys[layer].shape[2]), []).append(layer)
    out = {}
    for batch in batches.values():
        rot, positions = settings[batch[0]]
        turned = rot.rotate(torch.cat([keys[l] for l in batch], 1).transpose(0, 1),  # [heads of the batch, T, D]
                            torch.tensor(positions, dtype=torch.int64)).transpose(0, 1)
        at = 0
        for l in batch:
            heads = keys[l].shape[1]
            out[l] = turned[:, at:at + heads]
            at += heads
    return out
