"""HEVC elementary streams of code frames through PyAV: x265 lossless encode, FFmpeg decode.

A *code frame* is a ``[rows, cols]`` array of unsigned integer samples (``uint8``
for 8-bit HEVC Main, ``uint16`` for 10-bit Main10) that becomes the luma plane
of one picture; chroma is constant (mid-grey), so NVDEC and FFmpeg both decode it
as 4:2:0.  The encoder is x265 with ``lossless=1`` (transquant bypass), no
B-frames, one closed GOP with a keyframe at the start and headers repeated, so a
stream made here is an Annex-B HEVC elementary stream that decodes alone.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from kvcodec.codecs.kvfetcher.sps import check_parameter_sets
from kvcodec.errors import CorruptDataError, InvalidInputError

#: Smallest frame side accepted by NVDEC for HEVC (its ``GetDecoderCaps`` minimum); we never go below it.
MIN_SIDE = 144
#: Largest frame side (NVDEC's HEVC maximum).
MAX_SIDE = 8192


def pix_fmt(bits: int) -> str:
    return "yuv420p" if bits <= 8 else "yuv420p10le"


def _quiet() -> None:
    import av.logging
    av.logging.set_level(av.logging.PANIC)


def encode_frames(frames: Iterable[np.ndarray], bits: int, preset: str = "ultrafast") -> bytes:
    """Encode equally sized code frames (luma sample values < 2**bits, bits <= 10) into one HEVC stream."""
    import av

    _quiet()
    frames = list(frames)
    if not frames:
        raise InvalidInputError("no frames to encode")
    rows, cols = frames[0].shape
    if rows % 2 or cols % 2 or not (MIN_SIDE <= rows <= MAX_SIDE and MIN_SIDE <= cols <= MAX_SIDE):
        raise InvalidInputError(f"frame {rows}x{cols} must have even sides in {MIN_SIDE}..{MAX_SIDE}")
    dtype = np.uint8 if bits <= 8 else np.uint16
    ctx = av.CodecContext.create("libx265", "w")
    ctx.width, ctx.height = cols, rows
    ctx.pix_fmt = pix_fmt(bits)
    from fractions import Fraction
    ctx.time_base = Fraction(1, 25)
    ctx.framerate = Fraction(25, 1)
    n = len(frames)
    # x265 codes in the calling thread only (no pool, so no wavefront rows): a pool thread handing CTU rows back
    # and forth with it left the call waiting 3x its CPU time even on an idle core, and worse on a busy machine,
    # while the wavefront entry points cost 0.2% of the stream.  Sections already code in parallel, one per thread.
    params = ["lossless=1", "bframes=0", f"keyint={n + 1}", f"min-keyint={n + 1}", "scenecut=0",
              "open-gop=0", "repeat-headers=1", "annexb=1", "info=0", "log-level=none", "frame-threads=1",
              "pools=none", "wpp=0", "rc-lookahead=0" if n == 1 else "rc-lookahead=2"]
    ctx.options = {"preset": preset, "x265-params": ":".join(params)}
    ctx.gop_size = n + 1
    ctx.max_b_frames = 0
    mid = 1 << (bits - 1)
    chroma = np.full((rows // 2, cols), mid, dtype)  # U and V planes (rows/2 x cols/2 each) as from_ndarray wants them
    out = []
    for i, f in enumerate(frames):
        if f.shape != (rows, cols):
            raise InvalidInputError("frames of one stream must have one size")
        img = np.concatenate([f.astype(dtype, copy=False), chroma])
        vf = av.VideoFrame.from_ndarray(img, format=pix_fmt(bits))
        vf.pts = i
        for p in ctx.encode(vf):
            out.append(bytes(p))
    for p in ctx.encode(None):
        out.append(bytes(p))
    return b"".join(out)


def luma(frame, rows: int, cols: int, bits: int) -> np.ndarray:
    """The luma plane of a decoded PyAV frame as a ``[rows, cols]`` array (a copy)."""
    want = pix_fmt(bits)
    if frame.format.name != want or frame.width != cols or frame.height != rows:
        raise CorruptDataError(f"decoded a {frame.width}x{frame.height} {frame.format.name} picture, "
                               f"expected {cols}x{rows} {want}")
    plane = frame.planes[0]
    dtype = np.uint8 if bits <= 8 else np.uint16
    item = np.dtype(dtype).itemsize
    buf = np.frombuffer(plane, np.uint8)
    stride = plane.line_size
    if stride < cols * item or buf.size < stride * (rows - 1) + cols * item:
        raise CorruptDataError("decoded picture plane is too small")
    arr = np.lib.stride_tricks.as_strided(buf, (rows, cols * item), (stride, 1))
    return np.ascontiguousarray(arr).view(dtype).reshape(rows, cols)


class StreamDecoder:
    """Decodes one HEVC elementary stream fed in arbitrary byte pieces, yielding code frames as they appear.

    ``max_frames`` bounds the output: a stream that yields more pictures, or a
    picture of another size or format, raises :class:`CorruptDataError`; a stream
    whose parameter sets declare another picture is refused before FFmpeg decodes it.
    FFmpeg's own decode errors are CorruptDataError too.
    """

    def __init__(self, rows: int, cols: int, bits: int, max_frames: int) -> None:
        import av

        _quiet()
        self.rows, self.cols, self.bits, self.max_frames = rows, cols, bits, max_frames
        self.ctx = av.CodecContext.create("hevc", "r")
        self.ctx.thread_count = 1
        self.count = 0
        self.bytes_in = 0

    def _frames(self, packets) -> Iterator[np.ndarray]:
        import av

        for p in packets:
            if p is not None:
                check_parameter_sets(bytes(p), self.rows, self.cols, self.bits)
            try:
                decoded = self.ctx.decode(p)
            except av.FFmpegError as e:
                raise CorruptDataError(f"HEVC stream does not decode: {e}") from None
            for f in decoded:
                self.count += 1
                if self.count > self.max_frames:
                    raise CorruptDataError(f"HEVC stream holds more than {self.max_frames} pictures")
                yield luma(f, self.rows, self.cols, self.bits)

    def feed(self, piece: bytes) -> Iterator[np.ndarray]:
        import av

        if not piece:
            return
        self.bytes_in += len(piece)
        try:
            packets = self.ctx.parse(bytes(piece))
        except av.FFmpegError as e:
            raise CorruptDataError(f"HEVC stream does not parse: {e}") from None
        yield from self._frames(packets)

    def flush(self) -> Iterator[np.ndarray]:
        import av

        try:
            packets = self.ctx.parse(None)
        except (av.FFmpegError, TypeError):
            packets = []
        yield from self._frames(list(packets) + [None])


def decode_stream(pieces: Iterable[bytes], rows: int, cols: int, bits: int, max_frames: int) -> Iterator[np.ndarray]:
    """Every code frame of a stream given as byte pieces, in order."""
    dec = StreamDecoder(rows, cols, bits, max_frames)
    for piece in pieces:
        yield from dec.feed(piece)
    yield from dec.flush()
