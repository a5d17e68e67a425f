"""``fp8``: every element cast to float8 e4m3 (``torch.float8_e4m3fn``), one byte each; lossy.

Baseline for "just store it in FP8", as serving stacks do for their KV caches.
e4m3fn has 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities, and
its largest finite magnitude is 448.  The encoder **saturates**: values beyond
±448 are stored as ±448 (torch's own cast would turn them into NaN).  Everything
else is torch's cast, round to nearest even, subnormals included.  NaN and
infinite inputs are rejected (:class:`InvalidInputError`).

Section layout: key bytes ``[H, T, Dk]`` then value bytes ``[H, T, Dv]``, one
e4m3fn byte per element in C order.  Decoding casts each byte back to the
header dtype (exact: every e4m3fn value is a float16, bfloat16 and float32
value).  The NaN bytes ``0x7F`` and ``0xFF`` are never written, so a section
holding one is corrupt.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from kvcodec.codecs.base import Codec, LayerContext, expect_size
from kvcodec.codecs.registry import register_codec
from kvcodec.errors import CorruptDataError, InvalidInputError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_BITS16 = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _encode_table(dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """For a 16-bit dtype: (e4m3fn byte, is finite) of every one of its 65536 bit patterns, from torch's cast."""
    vals = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(dtype)
    codes = vals.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8).numpy().copy()
    return codes, torch.isfinite(vals).numpy().copy()


@functools.lru_cache(maxsize=None)
def _decode_table(dtype: torch.dtype) -> np.ndarray:
    """The header-dtype value of every e4m3fn byte, as that dtype's bits (uint16, or float32 for float32)."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float().to(dtype)
    return vals.view(torch.int16).numpy().view(np.uint16).copy() if dtype in _BITS16 else vals.numpy().copy()


def to_fp8_bytes(x: torch.Tensor) -> bytes:
    """The e4m3fn bytes of ``x`` (C order), saturating at ±448; NaN/inf raise InvalidInputError.

    16-bit dtypes go through a 65536-entry table built from torch's own cast (same bytes, no float
    arithmetic per element); float32 through torch directly.
    """
    x = x.detach().cpu().contiguous()
    if x.dtype in _BITS16:
        codes, finite = _encode_table(x.dtype)
        bits = x.view(torch.int16).numpy().view(np.uint16)
        if not bool(finite[bits].all()):
            raise InvalidInputError("fp8 cannot store non-finite values (NaN or inf) in the KV cache")
        return codes[bits].tobytes()
    if not bool(torch.isfinite(x).all()):
        raise InvalidInputError("fp8 cannot store non-finite values (NaN or inf) in the KV cache")
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8).numpy().tobytes()


def from_fp8_bytes(data: bytes | memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    raw = np.frombuffer(data, dtype=np.uint8)
    if bool(((raw & 0x7F) == 0x7F).any()):
        raise CorruptDataError("fp8 section holds a NaN byte (0x7F or 0xFF), which the encoder never writes")
    out = _decode_table(dtype)[raw]
    if dtype in _BITS16:
        return torch.from_numpy(out.view(np.int16)).view(dtype).reshape(shape)
    return torch.from_numpy(out).reshape(shape)


@register_codec
class Fp8(Codec):
    """float8 e4m3 (saturating at ±448): one byte per element, keys then values."""

    codec_id = "fp8"
    lossless = False

    def __init__(self) -> None:
        pass

    def get_config(self) -> dict[str, Any]:
        return {}

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        return to_fp8_bytes(keys) + to_fp8_bytes(values)

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        s = ctx.shape
        nk, nv = s.heads * s.tokens * s.key_dim, s.heads * s.tokens * s.value_dim
        expect_size(data, nk + nv, "fp8")
        view = memoryview(data)
        keys = from_fp8_bytes(view[:nk], (s.heads, s.tokens, s.key_dim), ctx.dtype)
        values = from_fp8_bytes(view[nk:], (s.heads, s.tokens, s.value_dim), ctx.dtype)
        return keys.to(ctx.device), values.to(ctx.device)
