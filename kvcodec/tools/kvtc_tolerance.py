"""spec/kvtc.md §10.8's decoding tolerance: how far two conforming decodes of one kvtc container may be apart
(kvtc's matrix products round by the machine's BLAS path, so its decodes agree only within it)."""

from __future__ import annotations

import torch

import kvcodec
from kvcodec.errors import UnsupportedError


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at ``|x|``, as float32."""
    a = x.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).float()


def kvtc_tolerance(blob: bytes, decoded: kvcodec.KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per element of each layer's keys and values, spec/kvtc.md §10.8's bound on how far two conforming decodes of the
    kvtc container ``blob`` may be apart before the conversion to the header dtype, computed from one of them:
    ``(K + 2) * 2**-22 * (|c_t| / weight_f + |mean_f|)`` per feature, summed over each rotary pair for keys.
    ``|c_t|``, the norm of the token's coefficients, is ``|basis^T z_t| <= |z_t|`` with ``z_t = (x_t - mean) *
    weight``; the ``2**-10`` term covers ``decoded``'s own rounding to float16."""
    from kvcodec.codecs.kvtc import KVTC

    with kvcodec.open(blob) as r:
        codec = KVTC.from_file_config(r.info.config)
        if "positions" in r.header.meta:  # the features below are taken at positions 0..T-1
            raise UnsupportedError("the kvtc tolerance is computed for a container at positions 0..T-1")
    cal = codec.calibration_data()
    t = decoded.num_tokens
    positions = torch.arange(t)
    out: dict[int, list[torch.Tensor]] = {}
    for g, members in enumerate(cal.groups):
        for side, (basis, coded) in enumerate(zip((cal.keys[g], cal.values[g]), codec.coded_components()[g])):
            feats = []
            for l in members:
                x = (decoded.layers[l].keys, decoded.layers[l].values)[side].float()
                if side == 0 and cal.layers[l].rotary is not None:
                    x = cal.layers[l].rotary.rotate(x, positions, inverse=True)
                feats.append(x.permute(1, 0, 2).reshape(t, -1))
            x = torch.cat(feats, 1).double()
            w, mean = basis.weight.double(), basis.mean.double()
            norm = ((x - mean) * w).norm(dim=1, keepdim=True) + (w * x.abs()).norm(dim=1, keepdim=True) * 2 ** -10
            bound = (coded + 2) * 2.0 ** -22 * (norm / w + mean.abs())
            start = 0
            for l in members:
                h, _, d = (decoded.layers[l].keys, decoded.layers[l].values)[side].shape
                b = bound[:, start:start + h * d].reshape(t, h, d).permute(1, 0, 2)
                start += h * d
                rot = cal.layers[l].rotary
                if side == 0 and rot is not None:  # a rotated key mixes its pair's two features
                    half = rot.dims // 2
                    pair = (b[..., :half] + b[..., half:2 * half]) * rot.scaling
                    b = torch.cat([pair, pair, b[..., 2 * half:]], -1)
                out.setdefault(l, []).append(b.float())
    return [tuple(out[l]) for l in range(decoded.num_layers)]


def assert_within_kvtc_tolerance(blob: bytes, got: kvcodec.KVCache, reference: kvcodec.KVCache) -> None:
    """Raise ``AssertionError`` naming the first layer where ``got`` differs from ``reference``, two decodes of the
    kvtc container ``blob``, by more than :func:`kvtc_tolerance` (computed from ``reference``) plus one unit in the
    last place of the dtype they are held in."""
    for i, (tols, a, b) in enumerate(zip(kvtc_tolerance(blob, reference), got.layers, reference.layers)):
        for tol, x, y in zip(tols, a, b):
            allowed = tol + _ulp(torch.maximum(x.abs(), y.abs()))
            excess = (x.float() - y.float()).abs() - allowed
            if float(excess.max()) > 0:
                raise AssertionError(f"layer {i}: a decode differs from the reference by more than SPEC allows")
