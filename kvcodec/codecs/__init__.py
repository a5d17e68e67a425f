"""Codecs and their registry.  Importing this package registers the built-in codecs."""

from kvcodec.codecs import fp8, kivi, lmcache_cachegen, raw, zstd  # noqa: F401  (registration side effect)
from kvcodec.codecs import cachegen  # noqa: F401,E402  (registration side effect)
from kvcodec.codecs import kvfetcher  # noqa: F401,E402  (registration side effect)
from kvcodec.codecs import kvtc  # noqa: F401,E402  (registration side effect)
from kvcodec.codecs.base import Codec, LayerContext
from kvcodec.codecs.registry import ENTRY_POINT_GROUP, codec_class, get_codec, list_codecs, register_codec

__all__ = ["Codec", "LayerContext", "ENTRY_POINT_GROUP", "codec_class", "get_codec", "list_codecs", "register_codec"]
