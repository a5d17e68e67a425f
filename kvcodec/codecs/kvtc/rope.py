"""The rotary position embedding (rotate-half convention, as transformers applies it), undone and redone.

A key at position ``p`` is stored as ``s * R(p) k`` where ``R(p)`` rotates each channel pair ``(i, i + r/2)``
(``r`` = the rotary dimensions, the first ``r`` of the head) by the angle ``p * inv_freq[i]`` and ``s`` is the
rotary embedding's attention scaling.  Angles are computed in float64 so that undoing and redoing at the same
positions returns the input to within float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Rotary:
    """One layer's rotary setting: ``inv_freq`` (float64, half the rotary dimensions) and the scaling."""

    inv_freq: np.ndarray
    scaling: float = 1.0

    @property
    def dims(self) -> int:
        return 2 * len(self.inv_freq)

    def _cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        angle = positions.to(torch.float64)[:, None].cpu() * torch.from_numpy(self.inv_freq)[None, :]
        return angle.cos().to(device), angle.sin().to(device)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x`` ``[..., T, D]`` rotated to ``positions`` ``[T]`` (or back from them when ``inverse``), float32."""
        cos, sin = self._cos_sin(positions, x.device)
        half = len(self.inv_freq)
        xd = x.to(torch.float64)
        a, b, rest = xd[..., :half], xd[..., half:2 * half], xd[..., 2 * half:]
        if inverse:
            ya, yb = (a * cos + b * sin) / self.scaling, (b * cos - a * sin) / self.scaling
        else:
            ya, yb = (a * cos - b * sin) * self.scaling, (b * cos + a * sin) * self.scaling
        return torch.cat([ya, yb, rest], -1).to(torch.float32)

    def move(self, keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Keys rotated at positions ``old`` re-rotated to positions ``new`` (one rotation by the difference)."""
        delta = Rotary(self.inv_freq, 1.0)
        return delta.rotate(keys, new.to(torch.float64) - old.to(torch.float64))
