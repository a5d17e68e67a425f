"""Checks an HEVC stream's sequence parameter sets against a section's declared picture before FFmpeg decodes.

FFmpeg sizes its picture buffers from the SPS, so a hostile stream inside a small section could otherwise make
it decode (and allocate) pictures far larger than the section's frame geometry before the size check on the
decoded picture fires.  Every SPS of every packet is read here first (ITU-T H.265 §7.3.2.2, up to the bit
depths) and must describe exactly the section's picture: its width and height after the conformance window,
4:2:0, and the bit depth of its pixel format.  The coded size may exceed the picture only by the padding to a
coding block (under 64 samples).  Layered (``nuh_layer_id > 0``) units, which kvcodec never writes, are refused.
"""

from __future__ import annotations

from kvcodec.errors import CorruptDataError

NAL_SPS = 33
MAX_PADDING = 64  # largest coding tree block side: the most the coded picture exceeds the displayed one


class _Bits:
    """An RBSP read bit by bit (emulation-prevention bytes already removed)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u(self, n: int) -> int:
        v = 0
        for _ in range(n):
            if self.pos >= 8 * len(self.data):
                raise CorruptDataError("HEVC sequence parameter set is truncated")
            v = (v << 1) | (self.data[self.pos >> 3] >> (7 - (self.pos & 7))) & 1
            self.pos += 1
        return v

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise CorruptDataError("HEVC sequence parameter set holds an over-long exp-Golomb code")
        return (1 << zeros) - 1 + self.u(zeros)


def _rbsp(nal: bytes) -> bytes:
    return nal.replace(b"\x00\x00\x03", b"\x00\x00")


def _nal_units(packet: bytes) -> list[bytes]:
    """The NAL units of an Annex-B byte string (start codes removed)."""
    starts, i = [], packet.find(b"\x00\x00\x01")
    while i >= 0:
        starts.append(i + 3)
        i = packet.find(b"\x00\x00\x01", i + 3)
    return [packet[a:(b - 3 if k + 1 < len(starts) else len(packet))] for k, (a, b) in
            enumerate(zip(starts, starts[1:] + [len(packet) + 3]))]


def sps_picture(rbsp: bytes) -> tuple[int, int, int, int, int, int, int]:
    """(displayed width, height, coded width, height, chroma_format_idc, luma bit depth, chroma bit depth)
    of an SPS payload (the RBSP after the two-byte NAL header)."""
    r = _Bits(rbsp)
    r.u(4)  # sps_video_parameter_set_id
    sub_layers = r.u(3)  # sps_max_sub_layers_minus1
    r.u(1)
    r.u(96)  # general profile, tier, compatibility flags, constraint flags and level
    present = [(r.u(1), r.u(1)) for _ in range(sub_layers)]
    if sub_layers:
        r.u(2 * (8 - sub_layers))
    for profile, level in present:
        r.u(88 * profile + 8 * level)
    r.ue()  # sps_seq_parameter_set_id
    chroma = r.ue()
    if chroma == 3:
        r.u(1)
    width, height = r.ue(), r.ue()
    crop = [r.ue() for _ in range(4)] if r.u(1) else [0, 0, 0, 0]
    sub_w, sub_h = (2, 2) if chroma == 1 else (2, 1) if chroma == 2 else (1, 1)
    shown = (width - sub_w * (crop[0] + crop[1]), height - sub_h * (crop[2] + crop[3]))
    return shown[0], shown[1], width, height, chroma, 8 + r.ue(), 8 + r.ue()


def check_parameter_sets(packet: bytes, rows: int, cols: int, bits: int) -> None:
    """Raise :class:`CorruptDataError` unless every SPS in ``packet`` (whole NAL units, as FFmpeg's parser
    delivers them) declares a ``cols`` x ``rows`` 4:2:0 picture of the section's bit depth."""
    depth = 8 if bits <= 8 else 10
    for nal in _nal_units(packet):
        if len(nal) < 2:
            continue
        if (nal[0] & 1) or (nal[1] >> 3):
            raise CorruptDataError("HEVC stream holds a layered NAL unit, which kvfetcher never writes")
        if (nal[0] >> 1) & 0x3F != NAL_SPS:
            continue
        w, h, cw, ch, chroma, luma_depth, chroma_depth = sps_picture(_rbsp(nal[2:]))
        if (w, h, chroma, luma_depth, chroma_depth) != (cols, rows, 1, depth, depth) or \
                not (0 <= cw - cols < MAX_PADDING and 0 <= ch - rows < MAX_PADDING):
            raise CorruptDataError(f"HEVC stream declares a {w}x{h} picture (coded {cw}x{ch}, chroma format {chroma}, "
                                   f"{luma_depth}/{chroma_depth} bits); the section's is {cols}x{rows}, 4:2:0, {depth} bits")
