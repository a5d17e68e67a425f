"""kvcodec: compress LLM KV caches for storage and transport.

>>> import torch, kvcodec
>>> kv = kvcodec.KVCache.from_tensors([torch.randn(2, 300, 16, dtype=torch.float16) for _ in range(2)],
...                                   [torch.randn(2, 300, 16, dtype=torch.float16) for _ in range(2)])
>>> blob = kvcodec.encode(kv, codec="kivi", bits=4)
>>> kvcodec.decode(blob).num_tokens
300
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvcodec.errors import (CorruptDataError, DeviceUnavailableError, InvalidInputError, KVCodecError,
                            LimitExceededError, MissingCalibrationError, UnknownCodecError, UnsupportedError,
                            UnsupportedVersionError)

if TYPE_CHECKING:
    from kvcodec.api import decode, encode, iter_encode, load, open, save
    from kvcodec.cache import KVCache, KVLayer
    from kvcodec.codecs import Codec, LayerContext, get_codec, list_codecs, register_codec
    from kvcodec.reader import Chunk, ContainerInfo, Reader

__version__ = "0.1.0"

# The public names that need torch, and where each is defined.  They load on first use, so that ``import kvcodec``
# takes 0.05 s, not 1.1 s, and the command line's own handler is in place before torch's import starts: a Ctrl-C
# during start-up printed a KeyboardInterrupt traceback from inside torch.
_LAZY = {
    **dict.fromkeys(["decode", "encode", "iter_encode", "load", "open", "save"], "kvcodec.api"),
    **dict.fromkeys(["KVCache", "KVLayer"], "kvcodec.cache"),
    **dict.fromkeys(["Codec", "LayerContext", "get_codec", "list_codecs", "register_codec"], "kvcodec.codecs"),
    **dict.fromkeys(["Chunk", "ContainerInfo", "Reader"], "kvcodec.reader"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvcodec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later uses find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "KVCache", "KVLayer", "Codec", "LayerContext", "get_codec", "list_codecs", "register_codec",
    "encode", "iter_encode", "decode", "save", "load", "open", "Reader", "ContainerInfo", "Chunk",
    "KVCodecError", "CorruptDataError", "InvalidInputError", "UnsupportedError", "UnsupportedVersionError",
    "UnknownCodecError", "DeviceUnavailableError", "LimitExceededError", "MissingCalibrationError", "__version__",
]
