"""Token positions in keys: the rotary position embedding (rotate-half convention, as transformers applies it),
undone and redone (:class:`Rotary`), and a cache's keys moved to new positions (:func:`reposition`).

A key at position ``p`` is stored as ``s * R(p) k`` where ``R(p)`` rotates each channel pair ``(i, i + r/2)``
(``r`` = the rotary dimensions, the first ``r`` of the head) by the angle ``p * inv_freq[i]`` and ``s`` is the
rotary embedding's attention scaling.  Angles are computed in float64 so that undoing and redoing at the same
positions returns the input to within float32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvcodec.cache import KVCache
from kvcodec.errors import InvalidInputError


# float64 elements per operand that Rotary.rotate works on at once on a CPU: its temporaries stay in the cache
BLOCK_ELEMENTS = 1 << 13


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
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        out[..., 2 * half:] = x[..., 2 * half:]
        lead = math.prod(x.shape[:-2])  # spelled out: -1 cannot size a tensor of no tokens
        rows, turned = x.reshape(lead, *x.shape[-2:]), out.view(lead, *x.shape[-2:])
        # on a CPU a few heads at a time, in place where the result is the same (multiplying or dividing by 1.0
        # changes nothing): a kvtc decode of a SmolLM2 chunk spent 21 ms here with a new float64 tensor per step
        # over all heads at once, 9 ms like this (measured on 90 heads of 253 tokens)
        step = max(1, BLOCK_ELEMENTS // max(1, x.shape[-2] * half) if x.device.type == "cpu" else lead)
        for i in range(0, len(rows), step):
            a = rows[i:i + step, :, :half].to(torch.float64, copy=True)
            b = rows[i:i + step, :, half:2 * half].to(torch.float64, copy=True)
            t, ya = b * sin, a * cos
            ya.add_(t) if inverse else ya.sub_(t)
            torch.mul(a, sin, out=t)
            b.mul_(cos)
            b.sub_(t) if inverse else b.add_(t)
            if self.scaling != 1.0:
                for y in (ya, b):
                    y.div_(self.scaling) if inverse else y.mul_(self.scaling)
            turned[i:i + step, :, :half], turned[i:i + step, :, half:2 * half] = ya, b
        return out

    def move(self, keys: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Keys rotated at positions ``old`` re-rotated to positions ``new`` (one rotation by the difference)."""
        delta = Rotary(self.inv_freq, 1.0)
        return delta.rotate(keys, new.to(torch.float64) - old.to(torch.float64))


def reposition(kv: KVCache, positions: Sequence[int], rotary: Sequence[Rotary | None] | None, *,
               layers: Sequence[int] | None = None) -> KVCache:
    """``kv`` with every layer's keys rotated from their positions (``kv.positions``, else 0..T-1) to
    ``positions`` (one per token of the longest layer; a shorter layer takes the last ones), for reusing cached
    chunks at other positions (CacheBlend-style).  ``rotary`` is the setting of each model layer (None for a layer
    without RoPE), e.g. a codec's :meth:`~kvcodec.codecs.Codec.rotary`; None, unknown, is an error once ``kv`` and
    ``positions`` pass their checks.  ``layers`` names the model layers ``kv`` holds, when it holds a selection."""
    if kv.rope != "post":
        raise InvalidInputError(f"moving keys to new positions needs a cache with rope='post' keys, not {kv.rope!r}")
    positions = [int(p) for p in positions]
    if len(positions) != kv.num_tokens:
        raise InvalidInputError(f"{len(positions)} positions for {kv.num_tokens} tokens")
    if rotary is None:
        raise InvalidInputError(f"no rotary setting is known for model {kv.model!r}: install a kvtc calibration "
                                "of it (kvcodec calibrate)")
    model_layers = list(range(kv.num_layers)) if layers is None else list(layers)
    old = torch.tensor(kv.positions if kv.positions is not None else range(kv.num_tokens), dtype=torch.int64)
    new = torch.tensor(positions, dtype=torch.int64)
    out = []
    for layer, l in zip(model_layers, kv.layers):
        rot = rotary[layer]
        t = l.keys.shape[1]
        keys = l.keys if rot is None or t == 0 else rot.move(l.keys, old[-t:], new[-t:]).to(l.keys.dtype)
        out.append((keys, l.values))
    return KVCache(out, model=kv.model, token_ids=kv.token_ids, rope="post", positions=positions)
