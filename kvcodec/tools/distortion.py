"""How far a decoded cache is from the original: per keys and values, over every layer."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvcodec.cache import KVCache, same_bits
from kvcodec.errors import InvalidInputError


@dataclass(frozen=True)
class Distortion:
    """``max_abs_error``: the largest |decoded - original|; ``relative_error``: ||decoded - original|| / ||original||
    (L2 over every element); ``snr_db``: 10 log10 of signal power over error power (inf when bit-exact)."""

    bit_exact: bool
    max_abs_error: float
    relative_error: float
    snr_db: float

    def describe(self) -> str:
        if self.bit_exact:
            return "bit-exact"
        return (f"max abs error {self.max_abs_error:.4g}, relative error {100 * self.relative_error:.3g}%, "
                f"SNR {self.snr_db:.1f} dB")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["snr_db"] = None if math.isinf(self.snr_db) else self.snr_db  # JSON has no infinity
        return out


def distortion(original: KVCache, decoded: KVCache) -> dict[str, Distortion]:
    """``{"keys": ..., "values": ...}`` of ``decoded`` against ``original`` (same shapes and dtype)."""
    if original.shapes != decoded.shapes or original.dtype != decoded.dtype:
        raise InvalidInputError("the caches differ in shapes or dtype; only equal shapes can be compared")
    out = {}
    for name in ("keys", "values"):
        pairs = [(getattr(a, name), getattr(b, name).to(getattr(a, name).device)) for a, b in zip(original.layers, decoded.layers)]
        exact = all(same_bits(x, y) for x, y in pairs)
        max_err, err2, sig2 = 0.0, 0.0, 0.0
        for x, y in pairs:
            x64, e64 = x.double(), y.double() - x.double()
            if e64.numel():
                max_err = max(max_err, float(e64.abs().max()))
            err2 += float((e64 * e64).sum())
            sig2 += float((x64 * x64).sum())
        relative = math.sqrt(err2 / sig2) if sig2 > 0 else (0.0 if err2 == 0 else math.inf)
        snr = math.inf if err2 == 0 else (10 * math.log10(sig2 / err2) if sig2 > 0 else -math.inf)
        out[name] = Distortion(exact, max_err, relative, snr)
    return out
