"""Lanes: independent ANS streams, each coding runs of symbols with per-run tables.

A lane is what one GPU thread block (or one CPU loop) codes on its own.  Runs
are encoded last-first so that a decoder reads them first-first (ANS is a
stack).  The stream is constriction's ``AnsCoder`` format: 64-bit state, 32-bit
words, 24-bit probabilities.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import constriction

from kvcodec.codecs.cachegen.tables import RADIX, models
from kvcodec.errors import CorruptDataError


def encode_lane(runs: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
    """Compress ``(symbols in [-RADIX, RADIX], table index)`` runs into uint32 words."""
    coder = constriction.stream.stack.AnsCoder()
    table_models = models()
    for symbols, table in reversed(runs):
        if symbols.size:
            coder.encode_reverse((symbols + RADIX).astype(np.int32), table_models[table])
    return coder.get_compressed()


def decode_lane(words: np.ndarray, runs: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """The runs ``(count, table index)`` back out of a lane; the lane must be used up exactly."""
    table_models = models()
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        out = [coder.decode(table_models[table], count).astype(np.int32) - RADIX if count else np.zeros(0, np.int32)
               for count, table in runs]
    except (ValueError, KeyError, RuntimeError) as e:  # constriction's words for "not a valid stream"
        raise CorruptDataError(f"a CacheGen lane is not a valid ANS stream: {e}") from None
    if not coder.is_empty():
        raise CorruptDataError("a CacheGen lane holds more data than its symbols need")
    return out
