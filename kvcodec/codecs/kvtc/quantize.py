"""kvtc's quantizer and what its symbols cost: shared by the encoder and the rate control's search, so that
the search prices exactly the symbols the encoder then codes."""

from __future__ import annotations

import numpy as np

from kvcodec.codecs.entropy.tables import RADIX, STEPS, code_lengths_fixed
from kvcodec.errors import InvalidInputError

CODE_LENGTH_UNIT = float(1 << 16)  # code_lengths_fixed() is in 1/2**16 bit


def quantize(coeff: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients ``[K, T]`` (float64) on each component's step code ``codes [K]``: the codes actually used
    (a component whose symbols would leave the codebook's range gets one just coarse enough) and the symbols."""
    codes = codes.astype(np.int64).copy()
    worst = np.abs(coeff).max(1, initial=0) / STEPS[codes]
    over = worst > RADIX
    codes[over] = np.minimum(255, codes[over] + 1 + np.ceil(8 * np.log2(worst[over] / RADIX)).astype(np.int64))
    q = np.rint(coeff / STEPS[codes][:, None].astype(np.float64)).astype(np.int64)
    if np.abs(q).max(initial=0) > RADIX:
        raise InvalidInputError("kvtc could not fit a component into its symbol range")
    return codes, q


def symbol_bits(q: np.ndarray) -> np.ndarray:
    """Bits each row of symbols costs under its cheapest codebook table (what the lanes will hold, within the
    ANS coder's <0.1%), 0 for an all-zero row (a dead component, not coded)."""
    rows = q.shape[0]
    if not rows:
        return np.zeros(0)
    magnitude = np.minimum(np.abs(q), RADIX)
    hist = np.bincount((np.arange(rows)[:, None] * (RADIX + 1) + magnitude).reshape(-1), minlength=rows * (RADIX + 1))
    hist = hist.reshape(rows, RADIX + 1)
    # an estimate, so a BLAS product is fine here (the encoder's table choice sums in a fixed order)
    bits = (hist.astype(np.float64) @ code_lengths_fixed()).min(1) / CODE_LENGTH_UNIT
    return np.where(hist[:, 0] == q.shape[1], 0.0, bits)
