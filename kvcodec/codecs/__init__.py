"""Codecs and their registry.  Importing this package registers the built-in codecs."""

from kvcodec.codecs import kivi, raw  # noqa: F401  (registration side effect)
from kvcodec.codecs.base import Codec, LayerContext
from kvcodec.codecs.registry import ENTRY_POINT_GROUP, codec_class, get_codec, list_codecs, register_codec

__all__ = ["Codec", "LayerContext", "ENTRY_POINT_GROUP", "codec_class", "get_codec", "list_codecs", "register_codec"]
