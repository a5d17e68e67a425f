"""Lanes: independent ANS streams, each coding runs of symbols with per-run tables.

A lane is what one GPU thread block (or one CPU loop) codes on its own.  Runs
are encoded last-first so that a decoder reads them first-first (ANS is a
stack).  The stream is constriction's ``AnsCoder`` format: 64-bit state, 32-bit
words, 24-bit probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import constriction

from kvcodec.codecs.entropy.tables import RADIX, models
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


@dataclass(frozen=True)
class Run:
    """Symbols coded with one table in a lane: ``rows`` (channels) by ``cols`` (tokens, or anchor
    indices when ``source == "anchor"``) of a symbol matrix, row-major."""

    source: str
    rows: np.ndarray
    cols: slice | np.ndarray
    width: int
    table: int

    @property
    def size(self) -> int:
        return len(self.rows) * self.width

    def gather(self, matrix: np.ndarray) -> np.ndarray:
        block = matrix[self.rows, self.cols] if isinstance(self.cols, slice) else matrix[np.ix_(self.rows, self.cols)]
        return block.reshape(-1)

    def scatter(self, matrix: np.ndarray, symbols: np.ndarray) -> None:
        block = symbols.reshape(len(self.rows), self.width)
        if isinstance(self.cols, slice):
            matrix[self.rows, self.cols] = block
        else:
            matrix[np.ix_(self.rows, self.cols)] = block


def table_runs(source: str, chans: np.ndarray, cols: slice | np.ndarray, width: int, table: np.ndarray) -> list[Run]:
    """One run per distinct table among ``chans``: its channels (in order) and the columns they code."""
    if not width:
        return []
    order = chans[np.argsort(table[chans], kind="stable")]  # by table, ties in channel order
    cuts = np.flatnonzero(np.diff(table[order])) + 1
    return [Run(source, rows, cols, width, int(table[rows[0]])) for rows in np.split(order, cuts)]
