"""Reading a section: typed arrays taken off its front in order."""

from __future__ import annotations

import numpy as np

from kvcodec.errors import CorruptDataError


class SectionBytes:
    """Reads typed arrays off the front of a section, refusing to run past its end."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def take(self, n: int, dtype: str) -> np.ndarray:
        """The next ``n`` items of ``dtype`` (a view, not a copy); :class:`CorruptDataError` past the end."""
        size = n * np.dtype(dtype).itemsize
        if self.pos + size > len(self.view):
            raise CorruptDataError("section is truncated")
        arr = np.frombuffer(self.view[self.pos:self.pos + size], dtype=dtype)
        self.pos += size
        return arr
