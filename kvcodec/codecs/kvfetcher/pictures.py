"""Frame layout: quantized KV codes as video frames, and the token delta along rows.

One frame = (K or V, a block of ``frame_rows`` tokens) of one section: row ``r``
is token ``block_start + r``, column ``h * D + d`` is head ``h``, channel ``d``.
Rows past the block's last token and columns past ``H * D``, up to the frame size
(even sides, at least :data:`MIN_SIDE`), hold the centre code ``2**(bits-1)``: a
constant costs the video coder almost nothing, where repeating the last token row
cost as much as real rows (4.7 against 2.7 bits per code for 64-token blocks in
144-row pictures, measured on SmolLM2 KV).
The token delta is taken per frame along rows, modulo ``2**bits``: the first
row is kept raw, row ``r > 0`` stores ``(q[r] - q[r-1]) mod 2**bits``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.codecs.kvfetcher.video import MAX_SIDE, MIN_SIDE
from kvcodec.errors import InvalidInputError

#: Rows come in multiples of the page size.
PAGE = 16


@dataclass(frozen=True)
class FrameGeometry:
    """Frame size and token blocks of one section."""

    tokens: int
    frame_rows: int  # tokens per frame (a multiple of PAGE, or the whole section when shorter)
    rows: int        # picture height (>= the tokens of a frame; padded)
    cols: int        # picture width
    channels: int    # H * D of the wider of K and V

    @property
    def blocks(self) -> int:
        return math.ceil(self.tokens / self.frame_rows)

    @property
    def num_frames(self) -> int:
        return 2 * self.blocks

    def block(self, b: int) -> tuple[int, int]:
        lo = b * self.frame_rows
        return lo, min(self.tokens, lo + self.frame_rows)

    @property
    def frame_bytes(self) -> int:
        return self.rows * self.cols


def _even_at_least(n: int, lo: int) -> int:
    return max(lo, n + (n & 1))


def geometry(tokens: int, heads: int, key_dim: int, value_dim: int, frame_rows: int) -> FrameGeometry:
    if frame_rows % PAGE or frame_rows < PAGE:
        raise InvalidInputError(f"frame rows must be a positive multiple of {PAGE}, not {frame_rows}")
    fr = min(frame_rows, PAGE * math.ceil(tokens / PAGE))
    rows = _even_at_least(fr, MIN_SIDE)
    ch = heads * max(key_dim, value_dim)
    cols = _even_at_least(ch, MIN_SIDE)
    if rows > MAX_SIDE or cols > MAX_SIDE:
        raise InvalidInputError(f"a {rows}x{cols} frame is larger than HEVC decoders take ({MAX_SIDE})")
    return FrameGeometry(tokens, fr, rows, cols, ch)


# ------------------------------------------------------------------------------------------ quantization

def code_dtype(bits: int) -> np.dtype:
    return np.dtype(np.uint8 if bits <= 8 else np.uint16)


# ------------------------------------------------------------------------------------------ frames

def to_frame(codes: np.ndarray, geo: FrameGeometry, bits: int, delta: bool = False,
             columns: np.ndarray | None = None) -> np.ndarray:
    """``[H, t, D]`` codes of one token block (``t <= frame_rows``) to a padded, delta-coded frame;
    frame column ``j`` holds channel ``columns[j]`` (``h * D + d``; default: channel ``j``)."""
    h, t, d = codes.shape
    rows2d = codes.transpose(1, 0, 2).reshape(t, h * d).astype(np.int32)
    if columns is not None:
        rows2d = rows2d[:, columns]
    img = np.full((geo.rows, geo.cols), 1 << (bits - 1), np.int32)
    img[:t, : h * d] = rows2d
    if delta:
        img[1:] = (img[1:] - img[:-1]) & ((1 << bits) - 1)
    return img.astype(code_dtype(bits))


def from_frame(frame: np.ndarray, t: int, h: int, d: int, bits: int, delta: bool = False,
               columns: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`to_frame`: ``[H, t, D]`` int32 codes from a decoded frame (undoing the delta)."""
    body = frame[:t, : h * d].astype(np.int32)
    if delta:
        body = np.cumsum(body, axis=0, dtype=np.int64).astype(np.int32) & ((1 << bits) - 1)
    if columns is not None:
        body, frame_order = np.empty_like(body), body
        body[:, columns] = frame_order
    return body.reshape(t, h, d).transpose(1, 0, 2)


def frame_to_torch(frame: torch.Tensor, t: int, h: int, d: int, bits: int, delta: bool = False,
                   columns: torch.Tensor | None = None) -> torch.Tensor:
    """The same as :func:`from_frame` on a torch luma plane (any device, ``columns`` on it too; ``int32`` codes
    ``[H, t, D]``).

    For 10-bit NVDEC output, pass the sample values already shifted down (NVDEC keeps them in the high bits).
    """
    body = frame[:t, : h * d].to(torch.int32)
    if delta:
        body = torch.cumsum(body, 0, dtype=torch.int32) & ((1 << bits) - 1)
    if columns is not None:
        body, frame_order = torch.empty_like(body), body
        body[:, columns] = frame_order
    return body.reshape(t, h, d).permute(1, 0, 2)
