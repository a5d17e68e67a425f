"""Triton kernels for kvcodec's GPU paths.

``cachegen.py`` holds the CacheGen codec's
kernels; ``kvcodec/codecs/cachegen/device.py`` stages their inputs and launches
them, and ``kvcodec/codecs/entropy/device.py`` the lane decoder's, which kvtc
shares.
"""
