"""The CacheGen codec: quantization and section layout (``codec``), parsed parts (``parts``) and the Triton
engine (``device``).  Its table codebook, step grid and lanes are :mod:`kvcodec.codecs.entropy`'s."""

from kvcodec.codecs.cachegen.codec import LEVELS, CacheGen

__all__ = ["CacheGen", "LEVELS"]
