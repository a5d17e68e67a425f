"""Fuzz seeds: valid containers of every codec (and a multi-level one) made from a slice of a real KV cache."""

from __future__ import annotations

from typing import Any

import numpy as np

import kvcodec
from kvcodec.cache import KVCache
from kvcodec.formats.v1 import Header
from kvcodec.fuzz.container import unseal
from kvcodec.fuzz.mutate import Seed

# name -> codec (id and options, or a list of codecs for a multi-level container)
SEED_CODECS: dict[str, Any] = {
    "raw": ("raw", {}),
    "kivi": ("kivi", {"bits": 2, "group": 16}),
    "fp8": ("fp8", {}),
    "zstd": ("zstd", {"level": 1}),
    "cachegen": ("cachegen", {}),
    "cachegen-anchor": ("cachegen", {"group": 4, "lane_channels": 32, "lane_tokens": 16}),
    "lmcache-cachegen": ("lmcache-cachegen", {}),
    "kvfetcher": ("kvfetcher", {"frame_tokens": 16}),
    "kvfetcher-minmax": ("kvfetcher", {"frame_tokens": 32, "bits": 10, "scale": "minmax", "delta": True}),
    "multi-level": [("kivi", {"bits": 2}), ("cachegen", {"level": 4})],
}
CHUNK_TOKENS, CHUNK_LAYERS = 32, 2


def fuzz_kv(kv: KVCache, tokens: int = 72, layers: int = 3, window: int = 40) -> KVCache:
    """A small real cache: the first ``layers`` layers over ``tokens`` tokens, the last layer a sliding window
    of ``window`` tokens (right-aligned, as SPEC.md §6.3 says), so that seeds have partial chunks and an empty section."""
    out = []
    for i in range(layers):
        k, v = kv.layers[i].keys[:, :tokens], kv.layers[i].values[:, :tokens]
        if i == layers - 1:
            k, v = k[:, -window:], v[:, -window:]
        out.append((k.contiguous(), v.contiguous()))
    return KVCache(out, model=kv.model)


def make_seeds(kv: KVCache, names: list[str] | None = None) -> list[Seed]:
    seeds = []
    for name in names or list(SEED_CODECS):
        spec = SEED_CODECS[name]
        if isinstance(spec, list):
            data = kvcodec.encode(kv, [kvcodec.get_codec(c, **o) for c, o in spec], chunk_tokens=CHUNK_TOKENS,
                                  chunk_layers=CHUNK_LAYERS)
        else:
            data = kvcodec.encode(kv, spec[0], chunk_tokens=CHUNK_TOKENS, chunk_layers=CHUNK_LAYERS, **spec[1])
        parts = unseal(data)
        seeds.append(Seed(name, data, parts, Header.from_json(parts.header)))
    return seeds


def hevc_donors() -> list[bytes]:
    """HEVC streams of other pictures than any seed's (sizes, bit depths), to splice into kvfetcher sections."""
    from kvcodec.codecs.kvfetcher.video import encode_frames

    rng = np.random.default_rng(0)
    return [encode_frames([rng.integers(0, 1 << bits, (rows, cols)).astype(np.uint16) for _ in range(n)], bits)
            for rows, cols, bits, n in ((144, 192, 10, 2), (160, 256, 4, 4), (400, 400, 8, 1), (144, 192, 4, 8))]
