"""A cachegen section's parts (keys, values) as parsed: their side information, their lanes, and the exact sink
tokens put back.  Shared by the CPU and Triton engines."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.codecs.entropy.tables import STEPS


@dataclass
class Side:
    """The side information of one part (keys or values) of a section: everything but the lanes."""

    mu: np.ndarray  # float16 [C]
    b_code: np.ndarray  # uint8 [C]
    a_code: np.ndarray | None  # uint8 [H * T], values only
    table: np.ndarray | None = None  # uint8 [C]
    anchor_table: np.ndarray | None = None  # uint8 [C] when group > 1

    def token_steps(self, h: int, t: int) -> np.ndarray:
        return STEPS[self.a_code].reshape(h, t) if self.a_code is not None else np.ones((h, t), np.float32)

    def pack(self) -> list[bytes]:
        fields = [self.mu.astype("<f2"), self.b_code, self.table, self.anchor_table, self.a_code]
        return [np.ascontiguousarray(f).tobytes() for f in fields if f is not None]


@dataclass
class Part:
    """A parsed part: ``(H, T, D)``, its side information, and its lanes' lengths and words."""

    shape: tuple[int, int, int]
    side: Side
    lengths: np.ndarray  # int64 [lanes]
    words: np.ndarray  # '<u4' [sum of lengths]


def with_sinks(x: torch.Tensor, sink: np.ndarray) -> torch.Tensor:
    if sink.shape[1]:
        x[:, :sink.shape[1]] = torch.from_numpy(sink.astype(np.float32)).to(x.device, x.dtype)
    return x
