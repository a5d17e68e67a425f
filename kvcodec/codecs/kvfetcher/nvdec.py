"""NVDEC decoding of ``kvfetcher`` sections through PyNvVideoCodec (CUDA only; imported lazily).

The same Annex-B HEVC elementary streams that PyAV writes are fed, in arbitrary
byte pieces, to PyNvVideoCodec's core ``Decoder``; each decoded NV12 (8-bit) or
P016 (10-bit, value in the high bits) surface is taken over DLPack as a torch
tensor on the GPU, its luma plane is turned back into codes (delta undone),
dequantized and scattered into the destination (paged blocks or a contiguous
tensor), then dropped, so only the decoder's own surfaces and one frame of
codes are live at once.

Not exercised without a GPU: ``bench/gpu_kvfetcher.py`` is its check.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.kvfetcher import layout as L
from kvcodec.errors import CorruptDataError, UnsupportedError


def _nvc() -> Any:
    try:
        import PyNvVideoCodec as nvc  # noqa: N813  (loads the NVDEC/NVENC libraries; CUDA machines only)
    except Exception as e:  # ImportError, or a missing driver library
        raise UnsupportedError(f"NVDEC decoding needs PyNvVideoCodec and an NVIDIA driver: {e}") from None
    return nvc


def decoder_caps(gpu: int = 0, bits: int = 8) -> dict[str, Any]:
    """NVDEC's HEVC 4:2:0 capabilities at ``bits`` bit depth on ``gpu`` (as far as PyNvVideoCodec exposes them)."""
    nvc = _nvc()
    for name in ("GetDecoderCaps", "get_decoder_caps"):
        fn = getattr(nvc, name, None)
        if fn is None:
            continue
        for kwargs in (dict(gpuid=gpu, codec=nvc.cudaVideoCodec.HEVC, chromaformat=nvc.cudaVideoChromaFormat.YUV420,
                            bitdepth=bits),
                       dict(gpu_id=gpu, codec=nvc.cudaVideoCodec.HEVC, chroma_format=nvc.cudaVideoChromaFormat.YUV420,
                            bit_depth=bits)):
            try:
                caps = fn(**kwargs)
                return dict(caps) if not isinstance(caps, dict) and hasattr(caps, "keys") else (
                    caps if isinstance(caps, dict) else {k: getattr(caps, k) for k in dir(caps) if not k.startswith("_")})
            except TypeError:
                continue
    dec = nvc.CreateDecoder(gpuid=gpu, codec=nvc.cudaVideoCodec.HEVC, usedevicememory=True)
    fn = getattr(dec, "GetDecoderCaps", None) or getattr(dec, "get_decoder_caps", None)
    if fn is None:
        return {"note": "this PyNvVideoCodec exposes no decoder caps query"}
    caps = fn()
    return caps if isinstance(caps, dict) else {k: getattr(caps, k) for k in dir(caps) if not k.startswith("_")}


class NvdecStream:
    """One HEVC elementary stream through NVDEC, fed in byte pieces; yields ``[rows, cols]`` int32 luma codes
    on the GPU, frame by frame."""

    def __init__(self, rows: int, cols: int, bits: int, max_frames: int, gpu: int = 0, stream: int = 0) -> None:
        self.nvc = _nvc()
        self.rows, self.cols, self.bits, self.max_frames = rows, cols, bits, max_frames
        self.dec = self.nvc.CreateDecoder(gpuid=gpu, codec=self.nvc.cudaVideoCodec.HEVC, cudacontext=0,
                                          cudastream=stream, usedevicememory=True)
        self.count = 0

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


def _frames(head: Any, ctx: LayerContext, pieces: Iterable[bytes] | None,
            gpu: int) -> Iterator[tuple[int, int, bool, torch.Tensor]]:
    """``(token_lo, token_hi, is_value, int32 codes [H, t, D])`` per picture NVDEC decodes, in stream order (the
    twin of :func:`kvcodec.codecs.kvfetcher.codec.iter_frames`); the codes stay where NVDEC put them."""
    s, geo = ctx.shape, head.geo
    nv = NvdecStream(geo.rows, geo.cols, head.bits, geo.num_frames, gpu)
    columns = None
    i = 0
    for piece in [*([bytes(head.stream)] if pieces is None else pieces), None]:
        for y in nv.feed(piece):
            if columns is None and head.scales.key_columns is not None:
                columns = torch.from_numpy(head.scales.key_columns).to(y.device)  # once, where the pictures land
            lo, hi = geo.block(i // 2)
            is_v = bool(i % 2)
            yield lo, hi, is_v, L.frame_to_torch(y, hi - lo, s.heads, s.value_dim if is_v else s.key_dim, head.bits,
                                                 head.delta, None if is_v else columns)
            i += 1
    if i != geo.num_frames:
        raise CorruptDataError(f"HEVC stream decoded to {i} pictures, its head says {geo.num_frames}")


def restore_nvdec(data: bytes, ctx: LayerContext, sink: Callable[[int, int, torch.Tensor | None, torch.Tensor | None], None],
                  pieces: Iterable[bytes] | None = None, gpu: int = 0, check: bool = True) -> None:
    """The NVDEC twin of :func:`kvcodec.codecs.kvfetcher.codec.restore`: NVDEC on GPU ``gpu`` decodes, and each frame
    is dequantized where it lands (on that GPU) and handed to ``sink``.

    ``check`` verifies the section's code digest (it copies each frame's codes to the host; turn it off to time
    the GPU path alone)."""
    import xxhash

    from kvcodec.codecs.kvfetcher.codec import SectionHead

    head = SectionHead(data, ctx)
    scales = head.scales.to(ctx.device)
    h = xxhash.xxh3_64()
    for lo, hi, is_v, q in _frames(head, ctx, pieces, gpu):
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
                       gpu: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """int32 codes ``[H, T, Dk]``, ``[H, T, Dv]`` decoded by NVDEC (for bit-exact comparison with PyAV)."""
    from kvcodec.codecs.kvfetcher.codec import SectionHead

    s = ctx.shape
    kq = np.empty((s.heads, s.tokens, s.key_dim), np.int32)
    vq = np.empty((s.heads, s.tokens, s.value_dim), np.int32)
    for lo, hi, is_v, q in _frames(SectionHead(data, ctx), ctx, pieces, gpu):
        (vq if is_v else kq)[:, lo:hi] = q.cpu().numpy()
    return kq, vq
