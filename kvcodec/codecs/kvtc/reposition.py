"""Position-independent reuse: move a decoded cache's keys to new positions (what CacheBlend-style non-prefix
reuse of cached chunks needs).  The rotary setting comes from a kvtc calibration of the cache's model."""

from __future__ import annotations

from typing import Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.codecs.kvtc.calibration import Calibration, calibration_for_model
from kvcodec.codecs.kvtc.rope import Rotary
from kvcodec.errors import InvalidInputError


def reposition(kv: KVCache, positions: Sequence[int], *, layers: Sequence[int] | None = None,
               calibration: Calibration | None = None, rotary: Sequence[Rotary | None] | None = None) -> KVCache:
    """``kv`` with every layer's keys rotated from their positions (``kv.positions``, else 0..T-1) to
    ``positions`` (one per token of the longest layer; a shorter layer takes the last ones).  ``layers`` names
    the model layers ``kv`` holds, when it holds a selection.  The rotary setting of each model layer comes from
    ``rotary``, else ``calibration``, else the kvtc calibration installed for ``kv.model``."""
    if kv.rope != "post":
        raise InvalidInputError(f"moving keys to new positions needs a cache with rope='post' keys, not {kv.rope!r}")
    positions = [int(p) for p in positions]
    if len(positions) != kv.num_tokens:
        raise InvalidInputError(f"{len(positions)} positions for {kv.num_tokens} tokens")
    if rotary is None:
        cal = calibration or calibration_for_model(kv.model)
        if cal is None:
            raise InvalidInputError(f"no rotary setting is known for model {kv.model!r}: install a kvtc calibration "
                                    "of it (kvcodec calibrate)")
        rotary = [l.rotary for l in cal.layers]
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
