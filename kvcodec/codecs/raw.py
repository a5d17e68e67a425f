"""``raw``: the tensors' own bytes, keys then values; lossless for every dtype."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcodec.codecs.base import Codec, LayerContext, expect_size
from kvcodec.codecs.registry import register_codec


def tensor_bytes(x: torch.Tensor) -> bytes:
    """The little-endian bytes of ``x`` in C order."""
    return x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not len(data):  # torch cannot view an empty byte tensor as a wider dtype
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).view(dtype).reshape(shape)


@register_codec
class Raw(Codec):
    """Stores each section as its dtype bytes: keys ``[H, T, Dk]`` then values ``[H, T, Dv]``."""

    codec_id = "raw"
    lossless = True

    def __init__(self) -> None:
        pass

    def get_config(self) -> dict[str, Any]:
        return {}

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        return tensor_bytes(keys) + tensor_bytes(values)

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        s, item = ctx.shape, ctx.dtype.itemsize
        nk = s.heads * s.tokens * s.key_dim * item
        expect_size(data, nk + s.heads * s.tokens * s.value_dim * item, "raw")
        view = memoryview(data)
        keys = tensor_from_bytes(view[:nk], ctx.dtype, (s.heads, s.tokens, s.key_dim))
        values = tensor_from_bytes(view[nk:], ctx.dtype, (s.heads, s.tokens, s.value_dim))
        return keys.to(ctx.device), values.to(ctx.device)
