"""Fuzz seeds: valid containers of every codec (and a multi-level one) made from a slice of a real KV cache."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import kvcodec
from kvcodec.cache import KVCache
from kvcodec.codecs import Codec
from kvcodec.codecs.kvtc.calibration import Calibration, LayerInfo
from kvcodec.codecs.kvtc.fit import default_groups, fit_calibration
from kvcodec.positions import Rotary
from kvcodec.formats.v1 import Header
from kvcodec.tools.fuzz.container import unseal
from kvcodec.tools.fuzz.mutate import Seed

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
    "kvtc": ("kvtc", {"level": 2}),  # over fuzz_calibration(cache)
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


def fuzz_calibration(kv: KVCache) -> Calibration:
    """A small kvtc calibration fitted on ``kv`` itself (milliseconds): groups of ``CHUNK_LAYERS`` layers (a
    shorter, sliding-window layer in a group of its own), unit weights and a made-up rotary setting, enough for
    valid kvtc containers of ``kv`` to mutate (their decoding, not their rate, is what the fuzzer looks at).
    It is named after ``kv``'s model and shapes, so that it never answers for a real model's calibration."""
    longest = kv.num_tokens
    layers, feats = [], []
    for l in kv.layers:
        h, t, d = l.keys.shape
        rotary = Rotary(10000.0 ** (-np.arange(0, d, 2, dtype=np.float64) / d))
        layers.append(LayerInfo(h, d, l.values.shape[2], rotary))
        keys = rotary.rotate(l.keys.float(), torch.arange(longest - t, longest), inverse=True)
        feats.append((keys.permute(1, 0, 2).reshape(t, -1), l.values.float().permute(1, 0, 2).reshape(t, -1)))
    groups = default_groups(layers, CHUNK_LAYERS, [l.keys.shape[1] < longest for l in kv.layers])
    keys, values = [k for k, _ in feats], [v for _, v in feats]
    return fit_calibration(f"kvcodec-fuzz:{kv.model}:{kv.num_layers}x{longest}", layers, groups, keys, values,
                           [torch.ones(k.shape[1]) for k in keys], [torch.ones(v.shape[1]) for v in values])


def seed_codecs(name: str, kv: KVCache) -> list[Codec]:
    """The codecs of seed ``name`` (several for a multi-level container) for the cache ``kv``."""
    spec = SEED_CODECS[name]
    codecs = []
    for codec, options in (spec if isinstance(spec, list) else [spec]):
        if codec == "kvtc":
            options = {**options, "calibration": fuzz_calibration(kv)}
        codecs.append(kvcodec.get_codec(codec, **options))
    return codecs


def make_seeds(kv: KVCache, names: list[str] | None = None) -> list[Seed]:
    seeds = []
    for name in names or list(SEED_CODECS):
        data = kvcodec.encode(kv, seed_codecs(name, kv), chunk_tokens=CHUNK_TOKENS, chunk_layers=CHUNK_LAYERS)
        parts = unseal(data)
        seeds.append(Seed(name, data, parts, Header.from_json(parts.header)))
    return seeds


def hevc_donors() -> list[bytes]:
    """HEVC streams of other pictures than any seed's (sizes, bit depths), to splice into kvfetcher sections."""
    from kvcodec.codecs.kvfetcher.video import encode_frames

    rng = np.random.default_rng(0)
    return [encode_frames([rng.integers(0, 1 << bits, (rows, cols)).astype(np.uint16) for _ in range(n)], bits)
            for rows, cols, bits, n in ((144, 192, 10, 2), (160, 256, 4, 4), (400, 400, 8, 1), (144, 192, 4, 8))]
