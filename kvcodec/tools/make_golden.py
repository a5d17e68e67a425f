"""Regenerate the golden containers in ``kvcodec/formats/golden/`` from real SmolLM2 KV.

    python -m kvcodec.tools.make_golden KV_DUMP.safetensors

The containers are frozen: regenerate only when the format version changes.
``golden/expected.json`` records, per file, the SHA-256 of the container and of
its decoded tensors (see :func:`decoded_digest`); the tests decode every file
and compare.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

import kvcodec
from kvcodec import formats
from kvcodec.codecs.kvtc import Calibration

GOLDEN = Path(formats.__file__).resolve().parent / "golden"
LAYERS = (0, 1, 15, 29)
TOKENS = 40
KVTC_CALIBRATION = "kvtc-calibration.kvtc"
SMOLLM2_ROPE_THETA = 100000.0  # SmolLM2-135M's rope_theta, for the golden kvtc calibration only


def golden_calibration(source: kvcodec.KVCache) -> Calibration:
    """A small kvtc calibration of the golden layers, fitted on the dump's tokens after the golden ones (one
    weight per layer, two groups of two layers, coarse truncation to keep the file small)."""
    import numpy as np

    from kvcodec.codecs.kvtc.calibration import LayerInfo
    from kvcodec.codecs.kvtc.fit import fit_calibration
    from kvcodec.positions import Rotary

    h, _, d = source.layers[0].keys.shape
    rot = Rotary(SMOLLM2_ROPE_THETA ** (-np.arange(0, d, 2, dtype=np.float64) / d))
    pos = torch.arange(TOKENS, source.num_tokens)
    keys = [rot.rotate(source.layers[i].keys[:, TOKENS:].float(), pos, inverse=True) for i in LAYERS]
    vals = [source.layers[i].values[:, TOKENS:].float() for i in LAYERS]
    flat = [x.permute(1, 0, 2).reshape(len(pos), -1) for x in keys + vals]
    # weights that make a unit of the level's steps a tenth of each layer's RMS, as calibrated weights roughly do
    kw = [torch.full((h * d,), 10 / float(x.pow(2).mean().sqrt())) for x in flat[:len(LAYERS)]]
    vw = [torch.full((h * d,), 10 / float(x.pow(2).mean().sqrt())) for x in flat[len(LAYERS):]]
    return fit_calibration(source.model, [LayerInfo(h, d, d, rot) for _ in LAYERS], [[0, 1], [2, 3]],
                           flat[:len(LAYERS)], flat[len(LAYERS):], kw, vw, (4.0, 4.0))


def decoded_digest(kv: kvcodec.KVCache) -> str:
    """SHA-256 of every layer's keys then values, as little-endian C-order bytes."""
    h = hashlib.sha256()
    for layer in kv.layers:
        for t in layer:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference_name(name: str) -> str:
    """The raw container holding the decode of golden file ``name`` on the machine that wrote it."""
    return name.removesuffix(".kvc") + ".reference.kvc"


def cases(source: kvcodec.KVCache) -> dict[str, tuple[str, kvcodec.KVCache, dict]]:
    meta = dict(model=source.model, rope=source.rope, token_ids=source.token_ids[:TOKENS])
    f16 = kvcodec.KVCache([(source.layers[i].keys[:, :TOKENS], source.layers[i].values[:, :TOKENS]) for i in LAYERS], **meta)
    window = kvcodec.KVCache([(l.keys[:, -24:], l.values[:, -24:]) if i == 3 else (l.keys, l.values)
                              for i, l in enumerate(f16.to(dtype=torch.float32).layers)], **meta)
    grid = dict(chunk_tokens=16, chunk_layers=2)
    return {
        "raw-f16.kvc": ("raw", f16, grid),
        "raw-bf16.kvc": ("raw", f16.to(dtype=torch.bfloat16), grid),
        "raw-f32-window.kvc": ("raw", window, grid),
        "kivi2-f16.kvc": ("kivi:bits=2,group=16", f16, grid),
        "kivi4-f16.kvc": ("kivi:bits=4,group=32", f16, dict(chunk_tokens=32)),
        "kivi8-f16.kvc": ("kivi:bits=8,group=128", f16, {}),
        # every component coded (min_std 0) and no fine rows, as before the options
        "kvtc-f16.kvc": ("kvtc:level=4,min_std=0,fine_tokens=0", f16, {}),
        "kvtc-fine-f16.kvc": ("kvtc:level=2,min_std=0.23,fine_tokens=3,fine_octaves=2", f16, {}),
    }


def main(dump: str) -> None:
    from kvcodec.cli import parse_codec

    from kvcodec.codecs.kvtc import register_calibration

    source = kvcodec.KVCache.load_safetensors(dump)
    GOLDEN.mkdir(exist_ok=True)
    cal = golden_calibration(source)
    cal.save(GOLDEN / KVTC_CALIBRATION)
    register_calibration(cal)
    expected = {}
    for name, (spec, kv, grid) in cases(source).items():
        codec = parse_codec(spec, [f"calibration={cal.digest}"] if spec.startswith("kvtc") else [])
        blob = kvcodec.encode(kv, codec, **grid)
        (GOLDEN / name).write_bytes(blob)
        expected[name] = {"codec": spec, "container_sha256": hashlib.sha256(blob).hexdigest(),
                          "decoded_sha256": decoded_digest(kvcodec.decode(blob)),
                          "source_sha256": decoded_digest(kv)}
        if spec.startswith("kvtc"):
            # float32 matrix products: the last bits of a decode depend on the platform, so the tests compare a
            # decode with this one, stored losslessly, within spec/kvtc.md §10.8's tolerance
            expected[name]["decoded_exact"] = False
            reference = reference_name(name)
            (GOLDEN / reference).write_bytes(kvcodec.encode(kvcodec.decode(blob), "raw"))
            expected[name]["reference"] = reference
    (GOLDEN / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
