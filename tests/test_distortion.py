"""How far a decode is from the original: bit-exact for lossless codecs, error and SNR for lossy ones (real KV)."""

from __future__ import annotations

import math

import pytest
import torch

import kvcodec
from kvcodec.tools.distortion import distortion


def test_lossless_is_bit_exact_and_lossy_is_measured(real_kv):
    d = distortion(real_kv, kvcodec.decode(kvcodec.encode(real_kv, "zstd")))
    assert all(v.bit_exact and v.max_abs_error == 0 and math.isinf(v.snr_db) for v in d.values())
    assert d["keys"].describe() == "bit-exact" and d["keys"].to_dict()["snr_db"] is None
    fine = distortion(real_kv, kvcodec.decode(kvcodec.encode(real_kv, "kivi", bits=8)))
    coarse = distortion(real_kv, kvcodec.decode(kvcodec.encode(real_kv, "kivi", bits=2)))
    for name in ("keys", "values"):
        f, c = fine[name], coarse[name]
        assert not f.bit_exact and 0 < f.max_abs_error < c.max_abs_error
        assert 0 < f.relative_error < c.relative_error < 1 and f.snr_db > c.snr_db > 0
        # 8 bits: about 6 dB a bit more than 2 bits
        assert f.snr_db - c.snr_db > 25


def test_numbers_match_their_definitions():
    x = torch.tensor([[[3.0, 4.0]]])
    y = torch.tensor([[[3.0, 3.0]]])
    a = kvcodec.KVCache([(x, x)])
    b = kvcodec.KVCache([(y, x)])
    d = distortion(a, b)
    assert d["values"].bit_exact and not d["keys"].bit_exact
    assert d["keys"].max_abs_error == 1.0 and math.isclose(d["keys"].relative_error, 1 / 5)
    assert math.isclose(d["keys"].snr_db, 10 * math.log10(25))


def test_kl_is_the_coarsened_divergence_from_the_reference():
    from kvcodec.tools.evaluate import KL_TOP, kl

    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(3 * torch.randn(40, 1000, generator=g), -1)
    top = ref.topk(KL_TOP, -1)
    assert kl(top, ref) == 0.0
    other = torch.log_softmax(ref + 0.5 * torch.randn(40, 1000, generator=g), -1)
    full = float((ref.exp() * (ref - other)).sum(1).mean())
    # the reference's top tokens, and one bucket for the rest, by hand
    p, q = ref.exp().gather(1, top.indices), other.exp().gather(1, top.indices)
    pr, qr = 1 - p.sum(1), 1 - q.sum(1)
    by_hand = float(((p * (p / q).log()).sum(1) + pr * (pr / qr).log()).mean())
    got = kl(top, other)
    assert got == pytest.approx(by_hand, rel=1e-6)
    assert 0 < got <= full and got > 0.9 * full  # a lower bound, close where the top tokens hold most of the mass
