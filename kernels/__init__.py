"""Triton kernels for kvcodec's GPU paths (installed as ``kvcodec.kernels``).

Kept at the top of the repository so kernel work is easy to find; the build
maps this folder into the package.  ``cachegen.py`` holds the CacheGen codec's
kernels; ``kvcodec/codecs/cachegen/device.py`` stages their inputs and launches
them, and ``kvcodec/codecs/entropy/device.py`` the lane decoder's, which kvtc
shares.
"""
