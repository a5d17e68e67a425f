"""NVDEC decoding of ``kvfetcher`` sections through PyNvVideoCodec (CUDA only; imported lazily).

The same Annex-B HEVC elementary streams that PyAV writes are fed, in arbitrary
byte pieces, to PyNvVideoCodec's core ``Decoder``; each decoded NV12 (8-bit) or
P016 (10-bit, value in the high bits) surface is taken over DLPack as a torch
tensor on the GPU, its luma plane is turned back into codes (delta undone),
dequantized and scattered into the destination (paged blocks or a contiguous
tensor), then dropped, so only the decoder's own surfaces and one frame of
codes are live at once.

Checked on an H200 by ``bench/gpu_kvfetcher.py`` (codes bit-exact against PyAV's; results in
bench/results/gpu_kvfetcher.md); on a CPU the tests drive the plumbing through a PyAV stand-in.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.kvfetcher import pictures as P
from kvcodec.codecs.kvfetcher.section import SectionHead
from kvcodec.codecs.kvfetcher.sps import check_parameter_sets
from kvcodec.errors import CorruptDataError, UnsupportedError


def _nvc() -> Any:
    try:
        import PyNvVideoCodec as nvc  # noqa: N813  (loads the NVDEC/NVENC libraries; CUDA machines only)
    except Exception as e:  # ImportError, or a missing driver library
        raise UnsupportedError(f"NVDEC decoding needs PyNvVideoCodec and an NVIDIA driver: {e}") from None
    return nvc


@functools.cache
def available() -> bool:
    """Whether PyNvVideoCodec imports here (what ``backend="auto"`` asks before choosing NVDEC)."""
    try:
        _nvc()
    except UnsupportedError:
        return False
    return True


def _chroma_420(nvc: Any) -> Any:
    """PyNvVideoCodec's 4:2:0 chroma member: its name differs between releases (2.2 has none called YUV420)."""
    enum = nvc.cudaVideoChromaFormat
    members = getattr(enum, "__members__", {}) or {k: getattr(enum, k) for k in dir(enum) if not k.startswith("__")}
    for name, member in members.items():
        if "420" in name:
            return member
    raise UnsupportedError(f"PyNvVideoCodec names no 4:2:0 chroma format (it has {sorted(members)})")


def _as_dict(caps: Any) -> dict[str, Any]:
    if isinstance(caps, dict):
        return caps
    return {k: getattr(caps, k) for k in dir(caps) if not k.startswith("_") and not callable(getattr(caps, k))}


def decoder_caps(gpu: int = 0, bits: int = 8) -> dict[str, Any]:
    """NVDEC's HEVC 4:2:0 capabilities at ``bits`` bit depth on ``gpu`` (as far as PyNvVideoCodec exposes them)."""
    nvc = _nvc()
    chroma = _chroma_420(nvc)
    for name in ("GetDecoderCaps", "get_decoder_caps"):
        fn = getattr(nvc, name, None)
        if fn is None:
            continue
        for kwargs in (dict(gpuid=gpu, codec=nvc.cudaVideoCodec.HEVC, chromaformat=chroma, bitdepth=bits),
                       dict(gpu_id=gpu, codec=nvc.cudaVideoCodec.HEVC, chroma_format=chroma, bit_depth=bits)):
            try:
                return _as_dict(fn(**kwargs))
            except TypeError:
                continue
    dec = nvc.CreateDecoder(gpuid=gpu, codec=nvc.cudaVideoCodec.HEVC, usedevicememory=True)
    fn = getattr(dec, "GetDecoderCaps", None) or getattr(dec, "get_decoder_caps", None)
    if fn is None:
        return {"note": "this PyNvVideoCodec exposes no decoder caps query"}
    return _as_dict(fn())


# Creating an NVDEC session costs far more than decoding one 256-token section, so finished sessions wait here
# for the next stream of the same picture geometry and bit depth (a cache's sections share one, and a session
# kept for its own size needs no reconfiguration).  A session is taken out while it decodes, so threads never
# share one, and one that failed is dropped rather than returned.  Each idle session holds decoder surfaces in GPU
# memory and one of the GPU's NVDEC sessions, so at most MAX_IDLE_SESSIONS wait, across geometries: the least
# recently returned go first (dicts keep insertion order; a geometry moves to the end when a session returns).
MAX_IDLE_SESSIONS = 8
_IDLE: dict[tuple[int, ...], list[Any]] = {}
_IDLE_LOCK = threading.Lock()


def _take_idle(key: tuple[int, ...]) -> Any:
    with _IDLE_LOCK:
        kept = _IDLE.get(key)
        if not kept:
            return None
        dec = kept.pop()
        if not kept:
            del _IDLE[key]
        return dec


def _keep_idle(key: tuple[int, ...], dec: Any) -> None:
    with _IDLE_LOCK:
        kept = _IDLE.pop(key, [])
        kept.append(dec)
        _IDLE[key] = kept
        extra = sum(len(v) for v in _IDLE.values()) - MAX_IDLE_SESSIONS
        while extra > 0:
            oldest = next(iter(_IDLE))
            del _IDLE[oldest][0]
            if not _IDLE[oldest]:
                del _IDLE[oldest]
            extra -= 1


class NvdecStream:
    """One HEVC elementary stream through NVDEC, fed in byte pieces; yields ``[rows, cols]`` int32 luma codes
    on the GPU, frame by frame."""

    def __init__(self, rows: int, cols: int, bits: int, max_frames: int, gpu: int = 0, stream: int = 0,
                 reuse: bool = True) -> None:
        self.nvc = _nvc()
        self.rows, self.cols, self.bits, self.max_frames = rows, cols, bits, max_frames
        self.key, self.reuse = (gpu, stream, bits, rows, cols), reuse
        self.dec = _take_idle(self.key) if reuse else None
        if self.dec is None:
            self.dec = self.nvc.CreateDecoder(gpuid=gpu, codec=self.nvc.cudaVideoCodec.HEVC, cudacontext=0,
                                              cudastream=stream, usedevicememory=True)
        self.count = 0

    def release(self) -> None:
        """Hand the session back for the next stream (call only after a clean end of stream)."""
        if self.reuse and self.dec is not None:
            _keep_idle(self.key, self.dec)
        self.dec = None

    def _luma(self, frame: Any) -> torch.Tensor:
        t = torch.from_dlpack(frame)
        if t.dim() == 3 and t.shape[-1] == 1:
            t = t[..., 0]
        if t.dim() != 2 or t.shape[0] < self.rows or t.shape[1] < self.cols:
            raise CorruptDataError(f"NVDEC produced a {tuple(t.shape)} surface for a {self.rows}x{self.cols} picture")
        y = t[: self.rows, : self.cols]
        if self.bits > 8:
            if y.dtype not in (torch.uint16, torch.int16):
                raise CorruptDataError(f"NVDEC returned {y.dtype} for a {self.bits}-bit stream")
            return (y.view(torch.int16).to(torch.int32) & 0xFFFF) >> 6  # P016: the 10 bits sit in the high bits
        return y.to(torch.int32)

    def _packets(self, piece: bytes | None) -> Iterator[Any]:
        pkt = self.nvc.PacketData()
        if piece:
            buf = np.frombuffer(piece, np.uint8)
            pkt.bsl_data = buf.ctypes.data
            pkt.bsl = buf.size
            self._keep = buf  # alive until Decode returns
        else:
            pkt.bsl_data, pkt.bsl = 0, 0  # end of stream: the parser flushes
        yield pkt

    def feed(self, piece: bytes | None) -> Iterator[torch.Tensor]:
        for pkt in self._packets(piece):
            try:
                frames = self.dec.Decode(pkt)
            except Exception as e:
                raise CorruptDataError(f"NVDEC could not decode the stream: {e}") from None
            for f in frames:
                self.count += 1
                if self.count > self.max_frames:
                    raise CorruptDataError(f"HEVC stream holds more than {self.max_frames} pictures")
                yield self._luma(f)

    def flush(self) -> Iterator[torch.Tensor]:
        yield from self.feed(None)


def _frames(head: Any, ctx: LayerContext, pieces: Iterable[bytes] | None, gpu: int,
            reuse: bool) -> Iterator[tuple[int, int, bool, torch.Tensor]]:
    """``(token_lo, token_hi, is_value, int32 codes [H, t, D])`` per picture NVDEC decodes, in stream order (the
    twin of :func:`kvcodec.codecs.kvfetcher.section.decoded_frames`); the codes stay where NVDEC put them."""
    s, geo = ctx.shape, head.geo
    if pieces is None:  # the whole stream is here: its parameter sets are checked before NVDEC sees it (spec/kvfetcher.md §10.7)
        check_parameter_sets(bytes(head.stream), geo.rows, geo.cols, head.bits)
    nv = NvdecStream(geo.rows, geo.cols, head.bits, geo.num_frames, gpu, reuse=reuse)
    columns = None
    i = 0
    for piece in [*([bytes(head.stream)] if pieces is None else pieces), None]:
        for y in nv.feed(piece):
            if columns is None and head.scales.key_columns is not None:
                columns = torch.from_numpy(head.scales.key_columns).to(y.device)  # once, where the pictures land
            lo, hi = geo.block(i // 2)
            is_v = bool(i % 2)
            yield lo, hi, is_v, P.frame_to_torch(y, hi - lo, s.heads, s.value_dim if is_v else s.key_dim, head.bits,
                                                 head.delta, None if is_v else columns)
            i += 1
    if i != geo.num_frames:
        raise CorruptDataError(f"HEVC stream decoded to {i} pictures, its head says {geo.num_frames}")
    nv.release()


def restore_nvdec(data: bytes, ctx: LayerContext, sink: Callable[[int, int, torch.Tensor | None, torch.Tensor | None], None],
                  pieces: Iterable[bytes] | None = None, gpu: int = 0, check: bool = True, reuse: bool = True) -> None:
    """The NVDEC twin of :func:`kvcodec.codecs.kvfetcher.section.restore`: NVDEC on GPU ``gpu`` decodes, and each frame
    is dequantized where it lands (on that GPU) and handed to ``sink``.

    ``check`` verifies the section's code digest (it copies each frame's codes to the host; turn it off to time
    the GPU path alone); ``reuse`` decodes through a kept NVDEC session instead of creating one per section."""
    import xxhash

    head = SectionHead(data, ctx)
    scales = head.scales.to(ctx.device)
    h = xxhash.xxh3_64()
    for lo, hi, is_v, q in _frames(head, ctx, pieces, gpu, reuse):
        if check:
            h.update(q.contiguous().cpu().numpy().astype("<i4").tobytes())
        x = head.dequantize(q, lo, hi, is_v, scales)
        if is_v:
            sink(lo, hi, None, x)
        else:
            sink(lo, hi, x, None)
    if check and h.intdigest() != head.digest:
        raise CorruptDataError("kvfetcher codes decoded by NVDEC do not match the section's checksum")


def decode_codes_nvdec(data: bytes, ctx: LayerContext, pieces: Iterable[bytes] | None = None,
                       gpu: int = 0, reuse: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """int32 codes ``[H, T, Dk]``, ``[H, T, Dv]`` decoded by NVDEC (for bit-exact comparison with PyAV)."""
    s = ctx.shape
    kq = np.empty((s.heads, s.tokens, s.key_dim), np.int32)
    vq = np.empty((s.heads, s.tokens, s.value_dim), np.int32)
    for lo, hi, is_v, q in _frames(SectionHead(data, ctx), ctx, pieces, gpu, reuse):
        (vq if is_v else kq)[:, lo:hi] = q.cpu().numpy()
    return kq, vq
