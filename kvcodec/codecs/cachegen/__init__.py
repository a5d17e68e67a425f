"""The CacheGen codec: quantization and section layout (``codec``), the fixed table codebook and
step grid (``tables``), and the lane-parallel ANS streams (``lanes``)."""

from kvcodec.codecs.cachegen.codec import LEVELS, CacheGen

__all__ = ["CacheGen", "LEVELS"]
