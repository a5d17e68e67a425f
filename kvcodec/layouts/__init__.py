"""Conversions between :class:`kvcodec.KVCache` and the layouts other tools use:
transformers caches, safetensors dumps, vLLM's paged blocks and LMCache's chunks."""
