"""kvcodec: compress LLM KV caches for storage and transport.

>>> import torch, kvcodec
>>> kv = kvcodec.KVCache.from_tensors([torch.randn(2, 300, 16, dtype=torch.float16) for _ in range(2)],
...                                   [torch.randn(2, 300, 16, dtype=torch.float16) for _ in range(2)])
>>> blob = kvcodec.encode(kv, codec="kivi", bits=4)
>>> kvcodec.decode(blob).num_tokens
300
"""

from kvcodec.api import decode, encode, iter_encode, load, open, save
from kvcodec.cache import KVCache, KVLayer
from kvcodec.codecs import Codec, LayerContext, get_codec, list_codecs, register_codec
from kvcodec.errors import (CorruptDataError, DeviceUnavailableError, InvalidInputError, KVCodecError,
                            LimitExceededError, MissingCalibrationError, UnknownCodecError, UnsupportedError,
                            UnsupportedVersionError)
from kvcodec.reader import Chunk, ContainerInfo, Reader

__version__ = "0.1.0"

__all__ = [
    "KVCache", "KVLayer", "Codec", "LayerContext", "get_codec", "list_codecs", "register_codec",
    "encode", "iter_encode", "decode", "save", "load", "open", "Reader", "ContainerInfo", "Chunk",
    "KVCodecError", "CorruptDataError", "InvalidInputError", "UnsupportedError", "UnsupportedVersionError",
    "UnknownCodecError", "DeviceUnavailableError", "LimitExceededError", "MissingCalibrationError", "__version__",
]
