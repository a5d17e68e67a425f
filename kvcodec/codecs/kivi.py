"""``kivi``: the KIVI baseline (Liu et al., 2024) as a storage format.

Asymmetric n-bit quantization, keys per channel over groups of ``group``
tokens (outlier channels get their own range), values per token; float16
scale and zero; codes bit-packed at a fixed width.  No entropy coding.

Section layout: key codes ``[H, T, Dk]`` packed, value codes ``[H, T, Dv]``
packed, then float16 key scales and zeros ``[H, ceil(T/group), Dk]`` and
float16 value scales and zeros ``[H, T]``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kvcodec.codecs import bitpack
from kvcodec.codecs.base import Codec, LayerContext, expect_size
from kvcodec.codecs.quantize import dequantize, group_tokens, minmax_params, quantize
from kvcodec.codecs.raw import tensor_bytes, tensor_from_bytes
from kvcodec.codecs.registry import register_codec
from kvcodec.errors import CorruptDataError, InvalidInputError


@register_codec
class Kivi(Codec):
    """KIVI quantization: ``bits`` in 2, 4, 8; ``group`` tokens share a key scale."""

    codec_id = "kivi"
    lossless = False

    def __init__(self, bits: int = 4, group: int = 128) -> None:
        if not isinstance(bits, int) or bits not in (2, 4, 8):
            raise InvalidInputError(f"kivi bits must be 2, 4 or 8, not {bits!r}")
        if not (isinstance(group, int) and 1 <= group <= 65536):
            raise InvalidInputError(f"kivi group must be an integer in 1..65536, not {group!r}")
        self.bits, self.group = bits, group

    def get_config(self) -> dict[str, Any]:
        return {"bits": self.bits, "group": self.group}

    @classmethod
    def presets(cls) -> list[dict[str, Any]]:
        return [{"bits": b} for b in (2, 4, 8)]

    def _sizes(self, ctx: LayerContext) -> tuple[int, int, int, int]:
        s = ctx.shape
        groups = math.ceil(s.tokens / self.group)
        return (bitpack.packed_size(s.heads * s.tokens * s.key_dim, self.bits),
                bitpack.packed_size(s.heads * s.tokens * s.value_dim, self.bits),
                2 * s.heads * groups * s.key_dim,
                2 * s.heads * s.tokens)

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        h, t, dk = keys.shape
        kg = group_tokens(keys.detach().float().cpu(), self.group)
        ks, kz = minmax_params(kg, 2, self.bits)
        kq = quantize(kg, ks, kz, self.bits).reshape(h, -1, dk)[:, :t]
        v = values.detach().float().cpu()
        vs, vz = minmax_params(v, 2, self.bits)
        vq = quantize(v, vs, vz, self.bits)
        return b"".join([bitpack.pack(kq.numpy(), self.bits), bitpack.pack(vq.numpy(), self.bits),
                         tensor_bytes(ks), tensor_bytes(kz), tensor_bytes(vs), tensor_bytes(vz)])

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        s = ctx.shape
        sizes = self._sizes(ctx)
        expect_size(data, sizes[0] + sizes[1] + 2 * sizes[2] + 2 * sizes[3], "kivi")
        ends = np.cumsum([sizes[0], sizes[1], sizes[2], sizes[2], sizes[3], sizes[3]])
        kq_b, vq_b, ks_b, kz_b, vs_b, vz_b = (memoryview(data)[a:b] for a, b in zip([0, *ends[:-1]], ends))
        groups = math.ceil(s.tokens / self.group)
        kq = torch.from_numpy(bitpack.unpack(kq_b, self.bits, s.heads * s.tokens * s.key_dim)).reshape(s.heads, s.tokens, s.key_dim)
        vq = torch.from_numpy(bitpack.unpack(vq_b, self.bits, s.heads * s.tokens * s.value_dim)).reshape(s.heads, s.tokens, s.value_dim)
        ks = tensor_from_bytes(ks_b, torch.float16, (s.heads, groups, 1, s.key_dim))
        kz = tensor_from_bytes(kz_b, torch.float16, (s.heads, groups, 1, s.key_dim))
        vs = tensor_from_bytes(vs_b, torch.float16, (s.heads, s.tokens, 1))
        vz = tensor_from_bytes(vz_b, torch.float16, (s.heads, s.tokens, 1))
        if not all(bool(torch.isfinite(t).all()) for t in (ks, kz, vs, vz)):
            raise CorruptDataError("kivi section has non-finite scales or zeros")
        width = min(self.group, s.tokens)  # a section shorter than a group is one group: pad nothing, whatever `group`
        pad = groups * width - s.tokens
        kq_g = torch.nn.functional.pad(kq, (0, 0, 0, pad)).reshape(s.heads, groups, width, s.key_dim)
        keys = dequantize(kq_g, ks, kz).reshape(s.heads, -1, s.key_dim)[:, : s.tokens]
        values = dequantize(vq, vs, vz)
        return keys.to(ctx.device, ctx.dtype), values.to(ctx.device, ctx.dtype)
