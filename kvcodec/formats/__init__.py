"""Container format definitions and golden files (installed as ``kvcodec.formats``).

``v1`` is the byte layout of format 1 (SPEC.md in prose); ``golden/`` holds
containers made from real SmolLM2 KV with the hashes of their decoded tensors.
"""
