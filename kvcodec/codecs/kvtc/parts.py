"""A kvtc part (keys or values of a group) as parsed, for the CPU and device decoders alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class CodedPart:
    """A part (keys or values of a group) as parsed: per coded component its table (``DEAD``: all zero) and step
    code, the live components, and the lanes' lengths and words."""

    tokens: int
    table: np.ndarray  # u1 [K]
    codes: np.ndarray  # int64 [K]
    live: np.ndarray  # int64, increasing
    lengths: np.ndarray  # int64 [lanes]
    words: np.ndarray  # '<u4' [sum of lengths]

    @property
    def span(self) -> int:
        """The components up to the last live one: those a decode multiplies by the basis."""
        return int(self.live[-1]) + 1 if len(self.live) else 0
