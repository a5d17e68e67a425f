"""Fixed-width packing of small unsigned codes, least significant bits first."""

from __future__ import annotations

import numpy as np


def packed_size(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack(codes: np.ndarray, bits: int) -> bytes:
    """Pack uint8 ``codes`` (each < 2**bits, bits in 1, 2, 4, 8) into bytes."""
    if bits == 8:
        return codes.astype(np.uint8, copy=False).tobytes()
    per = 8 // bits
    flat = codes.reshape(-1).astype(np.uint8, copy=False)
    pad = (-flat.size) % per
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    return np.bitwise_or.reduce(flat.reshape(-1, per) << shifts, axis=1).astype(np.uint8).tobytes()


def unpack(data: bytes | memoryview, bits: int, count: int) -> np.ndarray:
    """The first ``count`` codes of ``data``, as uint8."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if bits == 8:
        return raw[:count].copy()
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    codes = (raw[:, None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(-1)[:count]
