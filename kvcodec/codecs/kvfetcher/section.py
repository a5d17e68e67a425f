"""A ``kvfetcher`` section read back: its head and scale block parsed and checked (:class:`SectionHead`), its
HEVC stream decoded picture by picture (:func:`decoded_frames`) into codes or dequantized blocks.  The layout is in
:mod:`kvcodec.codecs.kvfetcher.codec`'s docstring; the encoder there writes what this reads."""

from __future__ import annotations

import struct
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import xxhash

from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.kvfetcher import pictures as P
from kvcodec.codecs.kvfetcher import scales as S
from kvcodec.codecs.kvfetcher import video
from kvcodec.codecs.raw import tensor_from_bytes
from kvcodec.errors import CorruptDataError, InvalidInputError

MAGIC = b"KVF1"
HEAD = struct.Struct("<4sBBHHHHIQH")
FLAG_DELTA = 1  # bit 1 (S.FLAG_STEP_CODES) says which scale block follows the head


class SectionHead:
    """The parsed, validated head and scale block of one section."""

    def __init__(self, data: bytes | memoryview, ctx: LayerContext) -> None:
        s = ctx.shape
        if len(data) < HEAD.size:
            raise CorruptDataError(f"kvfetcher section of {len(data)} bytes is shorter than its head")
        magic, bits, flags, frame_rows, rows, cols, nframes, stream_len, digest, exact = HEAD.unpack_from(data)
        if magic != MAGIC:
            raise CorruptDataError("kvfetcher section has a bad magic")
        if not 2 <= bits <= 10 or flags & ~(FLAG_DELTA | S.FLAG_STEP_CODES):
            raise CorruptDataError(f"kvfetcher section has bits={bits}, flags={flags}")
        try:
            geo = P.geometry(s.tokens, s.heads, s.key_dim, s.value_dim, frame_rows)
        except InvalidInputError as e:
            raise CorruptDataError(f"kvfetcher section: {e}") from None
        if (geo.frame_rows, geo.rows, geo.cols, geo.num_frames) != (frame_rows, rows, cols, nframes):
            raise CorruptDataError("kvfetcher section's frame geometry does not match its shape")
        if exact > s.tokens:
            raise CorruptDataError(f"kvfetcher section has {exact} exact tokens of {s.tokens}")
        self.bits, self.delta, self.geo, self.digest = bits, bool(flags & FLAG_DELTA), geo, digest
        dims = (s.heads, s.tokens, s.key_dim, s.value_dim)
        scale_end = HEAD.size + S.size(flags, *dims)
        self.stream_start = scale_end + 2 * s.heads * exact * (s.key_dim + s.value_dim)
        if len(data) != self.stream_start + stream_len:
            raise CorruptDataError(f"kvfetcher section is {len(data)} bytes; its head says {self.stream_start + stream_len}")
        mv = memoryview(data)
        self.scales = S.parse(mv[HEAD.size:scale_end], flags, *dims, bits)
        o = scale_end + 2 * s.heads * exact * s.key_dim
        self.exact = (tensor_from_bytes(mv[scale_end:o], torch.float16, (s.heads, exact, s.key_dim)),
                      tensor_from_bytes(mv[o:self.stream_start], torch.float16, (s.heads, exact, s.value_dim)))
        self.stream = mv[self.stream_start:]

    def dequantize(self, q: torch.Tensor, lo: int, hi: int, is_value: bool,
                   scales: S.FloatScales | S.StepScales | None = None) -> torch.Tensor:
        """The values of block ``[lo, hi)`` from its codes ``q``, with the section's exact tokens put back;
        ``scales`` is this section's scale block moved to ``q``'s device (default: as parsed, on the CPU)."""
        sc = self.scales if scales is None else scales
        x = sc.values(q, lo, hi) if is_value else sc.keys(q)
        exact = self.exact[is_value]
        if lo < exact.shape[1]:
            x[:, :exact.shape[1] - lo] = exact[:, lo:hi].to(x.device, x.dtype)
        return x


def codes_digest(kq: np.ndarray, vq: np.ndarray, geo: P.FrameGeometry) -> int:
    """xxh3-64 of the codes in frame order: for each block, its key codes ``[H, t, Dk]`` then its value
    codes ``[H, t, Dv]``, as int32 little-endian."""
    h = xxhash.xxh3_64()
    for b in range(geo.blocks):
        lo, hi = geo.block(b)
        h.update(np.ascontiguousarray(kq[:, lo:hi], "<i4").tobytes())
        h.update(np.ascontiguousarray(vq[:, lo:hi], "<i4").tobytes())
    return h.intdigest()


def decoded_frames(head: SectionHead, ctx: LayerContext,
                pieces: Iterable[bytes] | None = None) -> Iterator[tuple[int, int, bool, np.ndarray]]:
    """``(token_lo, token_hi, is_value, codes [H, t, D])`` per decoded frame, in stream order.

    ``pieces`` (default: the section's stream in one piece) feeds the HEVC decoder in arbitrary byte pieces.
    """
    s, geo = ctx.shape, head.geo
    dec = video.StreamDecoder(geo.rows, geo.cols, head.bits, geo.num_frames)
    src = [bytes(head.stream)] if pieces is None else pieces
    i = 0

    def frames() -> Iterator[np.ndarray]:
        for piece in src:
            yield from dec.feed(piece)
        yield from dec.flush()

    for f in frames():
        lo, hi = geo.block(i // 2)
        is_v = bool(i % 2)
        yield lo, hi, is_v, P.from_frame(f, hi - lo, s.heads, s.value_dim if is_v else s.key_dim, head.bits, head.delta,
                                         None if is_v else head.scales.key_columns)
        i += 1
    if i != geo.num_frames:
        raise CorruptDataError(f"HEVC stream decoded to {i} pictures, its head says {geo.num_frames}")


def restore(data: bytes, ctx: LayerContext,
            sink: Callable[[int, int, torch.Tensor | None, torch.Tensor | None], None],
            pieces: Iterable[bytes] | None = None) -> None:
    """Decode a section frame by frame, handing each dequantized block to ``sink(lo, hi, keys, values)``
    (one of keys/values is None) as soon as its frame is decoded; at most one frame's codes are held.

    Raises :class:`CorruptDataError` after the last frame if the codes do not match the section's digest
    (the sink has then already seen the bad blocks)."""
    head = SectionHead(data, ctx)
    h = xxhash.xxh3_64()
    for lo, hi, is_v, q in decoded_frames(head, ctx, pieces):
        q = np.ascontiguousarray(q, "<i4")
        h.update(q.tobytes())
        x = head.dequantize(torch.from_numpy(q), lo, hi, is_v)
        if is_v:
            sink(lo, hi, None, x)
        else:
            sink(lo, hi, x, None)
    if h.intdigest() != head.digest:
        raise CorruptDataError("kvfetcher codes do not match the section's checksum")


def decode_codes(data: bytes, ctx: LayerContext, pieces: Iterable[bytes] | None = None) -> tuple[np.ndarray, np.ndarray]:
    s = ctx.shape
    head = SectionHead(data, ctx)
    kq = np.empty((s.heads, s.tokens, s.key_dim), np.int32)
    vq = np.empty((s.heads, s.tokens, s.value_dim), np.int32)
    for lo, hi, is_v, q in decoded_frames(head, ctx, pieces):
        (vq if is_v else kq)[:, lo:hi] = q
    if codes_digest(kq, vq, head.geo) != head.digest:
        raise CorruptDataError("kvfetcher codes do not match the section's checksum")
    return kq, vq
