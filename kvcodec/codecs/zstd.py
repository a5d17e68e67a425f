"""``zstd``: the section's ``raw`` bytes compressed with Zstandard; lossless for every dtype.

Baseline for "a general-purpose lossless compressor on the tensor bytes".
The section is one Zstandard frame (RFC 8878) whose decompressed content is
exactly the ``raw`` section (keys ``[H, T, Dk]`` then values ``[H, T, Dv]``,
dtype bytes, C order).  The frame carries its content size and no checksum
(the container already checksums every section) and uses no dictionary.

Decoding never trusts the frame: its declared content size must be exactly
``H·T·(Dk+Dv)·e`` before anything is allocated, the output is capped at that
size, and trailing bytes after the frame are corrupt data.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.codecs.base import Codec, LayerContext
from kvcodec.codecs.raw import tensor_bytes, tensor_from_bytes
from kvcodec.codecs.registry import register_codec
from kvcodec.errors import CorruptDataError, InvalidInputError

FRAME_MAGIC = b"\x28\xb5\x2f\xfd"  # 0xFD2FB528 little-endian; skippable frames are not accepted
MIN_LEVEL = -(1 << 17)  # zstd's fastest "negative" level (ZSTD_minCLevel)
MAX_LEVEL = 22


@register_codec
class Zstd(Codec):
    """Zstandard at ``level`` (1…22, or a negative fast level; not 0) over the raw section bytes."""

    codec_id = "zstd"
    lossless = True

    def __init__(self, level: int = 3) -> None:
        if not (isinstance(level, int) and not isinstance(level, bool) and MIN_LEVEL <= level <= MAX_LEVEL
                and level != 0):
            raise InvalidInputError(f"zstd level must be an integer in 1..{MAX_LEVEL} or {MIN_LEVEL}..-1, not {level!r}")
        self.level = level

    def get_config(self) -> dict[str, Any]:
        return {"level": self.level}

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        import zstandard  # on use: importing kvcodec should not need every baseline's library

        cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True, write_checksum=False,
                                        write_dict_id=False, threads=0)
        return cctx.compress(tensor_bytes(keys) + tensor_bytes(values))

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        s, item = ctx.shape, ctx.dtype.itemsize
        nk = s.heads * s.tokens * s.key_dim * item
        expected = nk + s.heads * s.tokens * s.value_dim * item
        if bytes(data[:4]) != FRAME_MAGIC:
            raise CorruptDataError("zstd section does not start with a zstd frame")
        import zstandard

        try:
            params = zstandard.get_frame_parameters(data)
        except zstandard.ZstdError as e:
            raise CorruptDataError(f"zstd section is not a zstd frame: {e}") from None
        if params.content_size != expected:
            raise CorruptDataError(f"zstd frame declares {params.content_size} bytes, the section's shape needs {expected}")
        if params.dict_id != 0:
            raise CorruptDataError("zstd frame needs a dictionary")
        try:
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise CorruptDataError(f"zstd section does not decompress: {e}") from None
        if len(raw) != expected:
            raise CorruptDataError(f"zstd section decompressed to {len(raw)} bytes, its shape needs {expected}")
        view = memoryview(raw)
        keys = tensor_from_bytes(view[:nk], ctx.dtype, (s.heads, s.tokens, s.key_dim))
        values = tensor_from_bytes(view[nk:], ctx.dtype, (s.heads, s.tokens, s.value_dim))
        return keys.to(ctx.device), values.to(ctx.device)
