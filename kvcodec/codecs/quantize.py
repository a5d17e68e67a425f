"""Asymmetric min-max quantization with float16 scale and zero point.

The scale and zero are rounded to float16 *before* quantizing, so the encoder
quantizes against exactly the numbers the decoder will multiply by.
"""

from __future__ import annotations

import torch

from kvcodec.errors import InvalidInputError

FP16_MAX = 65504.0


def minmax_params(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 ``(scale, zero)`` per slice of ``x`` reduced over ``dim`` (kept as size 1)."""
    if not bool(torch.isfinite(x).all()):
        raise InvalidInputError("cannot quantize non-finite values (NaN or inf) in the KV cache")
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    if float(hi.max()) > FP16_MAX or float(lo.min()) < -FP16_MAX or float((hi - lo).max()) > FP16_MAX:
        raise InvalidInputError("values beyond float16 range cannot be quantized with float16 scales")
    scale = ((hi - lo) / ((1 << bits) - 1)).to(torch.float16)
    return scale, lo.to(torch.float16)


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in ``[0, 2**bits)``, uint8 up to 8 bits and int32 above; a zero scale (constant slice) gives code 0."""
    s = scale.float()
    q = torch.round((x - zero.float()) / torch.where(s == 0, 1.0, s))
    q = torch.where(s == 0, 0.0, q)
    return q.clamp_(0, (1 << bits) - 1).to(torch.uint8 if bits <= 8 else torch.int32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return zero.float() + q.float() * scale.float()


def group_tokens(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[H, T, D]`` to ``[H, G, group, D]``, padding the last group by repeating the last token
    (which leaves its min and max unchanged)."""
    h, t, d = x.shape
    pad = (-t) % group
    if pad:
        x = torch.cat([x, x[:, -1:].expand(h, pad, d)], dim=1)
    return x.reshape(h, -1, group, d)
