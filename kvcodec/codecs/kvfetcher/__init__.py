"""``kvfetcher``: KV caches as lossless HEVC video (frame layout, PyAV and NVDEC decoders, resolution ladder)."""

from kvcodec.codecs.kvfetcher.codec import KVFetcher
from kvcodec.codecs.kvfetcher.section import decode_codes, restore

__all__ = ["KVFetcher", "decode_codes", "restore"]
