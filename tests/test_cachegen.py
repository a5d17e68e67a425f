"""CacheGen on real SmolLM2 KV: error bounds, levels, lanes bit-exact through constriction, corruption."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.chunking import layer_context
from kvcodec.tools.ans_reference import reference_decode, reference_encode
from kvcodec.codecs.cachegen import LEVELS, CacheGen
from kvcodec.codecs.entropy import tables
from kvcodec.formats.v1 import Header


@pytest.fixture(scope="module")
def small_real(real_kv):
    """Six real layers (shallow and middle) of the 512-token cache, with its metadata."""
    picks = [0, 1, 9, 10, 15, 29]
    return kvcodec.KVCache([real_kv.layers[i] for i in picks], model=real_kv.model, token_ids=real_kv.token_ids,
                           rope=real_kv.rope)


def _sections(blob: bytes):
    with kvcodec.open(blob) as r:
        for i in range(r.num_chunks):
            frame = r._container.read_frame(i)
            e = frame.entry
            for layer, data in frame.sections.items():
                lo, hi = r.header.local_range(layer, e.token_start, e.token_count)
                yield r.codecs[e.variant], layer_context(r.header, layer, (lo, hi), torch.device("cpu")), lo, hi, data


@pytest.mark.parametrize("config", [dict(level=0), dict(level=2), dict(level=4), dict(level=2, profile="none"),
                                    dict(level=2, group=4), dict(level=3, lane_channels=5, lane_tokens=100)])
def test_round_trip_within_error_bound_on_real_kv(small_real, config):
    blob = kvcodec.encode(small_real, "cachegen", chunk_tokens=200, **config)
    back = kvcodec.decode(blob)
    assert back.shapes == small_real.shapes and back.dtype == torch.float16
    checked = 0
    for codec, ctx, lo, hi, data in _sections(blob):
        kb, vb = codec.error_bounds(data, ctx)
        layer = ctx.layer
        for orig, dec, bound in ((small_real.layers[layer].keys, back.layers[layer].keys, kb),
                                 (small_real.layers[layer].values, back.layers[layer].values, vb)):
            o, d = orig[:, lo:hi].float().numpy(), dec[:, lo:hi].float().numpy()
            # half a step, plus float16 rounding of the output
            slack = bound * 1.0001 + np.abs(d) * 2.0 ** -11 + 1e-7
            assert (np.abs(o - d) <= slack).all(), f"layer {layer} exceeds its error bound"
            checked += o.size
    assert checked == small_real.num_elements


def test_levels_trade_bits_for_error(small_real):
    sizes, errors = [], []
    for level in sorted(LEVELS):
        blob = kvcodec.encode(small_real, "cachegen", level=level)
        back = kvcodec.decode(blob)
        sizes.append(len(blob))
        errors.append(sum(float((a.keys.float() - b.keys.float()).pow(2).mean() + (a.values.float() - b.values.float()).pow(2).mean())
                          for a, b in zip(small_real.layers, back.layers)))
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert errors == sorted(errors, reverse=True)
    assert 8 * sizes[0] / small_real.num_elements < 2.0 < 8 * sizes[-1] / small_real.num_elements


def test_encoding_is_deterministic(small_real):
    a = kvcodec.encode(small_real, "cachegen", level=1)
    b = kvcodec.encode(small_real, "cachegen", level=1)
    assert a == b


def test_profile_changes_steps_and_auto_finds_the_shipped_one(small_real):
    with_profile = kvcodec.encode(small_real, "cachegen")
    explicit = kvcodec.encode(small_real, "cachegen", profile="none")
    assert with_profile != explicit
    anonymous = kvcodec.KVCache(small_real.layers)  # no model id: no profile to find
    assert kvcodec.decode(kvcodec.encode(anonymous, "cachegen")).equal(
        kvcodec.decode(kvcodec.encode(anonymous, "cachegen", profile="none")))


def test_codebook_is_the_frozen_one():
    data = tables.build_codebook().astype("<u4").tobytes()
    assert hashlib.sha256(data).hexdigest() == tables.CODEBOOK_SHA256
    assert (tables.codebook().sum(1) == 1 << tables.PRECISION).all() and tables.codebook().min() >= 1


def test_step_grid_is_exact_powers_of_two_eighths():
    assert tables.STEPS[128] == 1.0 and tables.STEPS[136] == 2.0 and tables.STEPS[120] == 0.5
    ratios = tables.STEPS[1:].astype(np.float64) / tables.STEPS[:-1]
    assert np.allclose(ratios, 2 ** (1 / 8), rtol=1e-6)


def test_lanes_are_bit_exact_with_the_reference_coder(small_real):
    """Every lane of a real section equals what the reference ANS coder (the GPU kernel's spec) makes."""
    codec = kvcodec.get_codec("cachegen", level=2, lane_channels=16)
    blob = kvcodec.encode(kvcodec.KVCache(small_real.layers[:2], model=small_real.model), codec, chunk_tokens=256)
    lanes_checked = 0
    for codec, ctx, lo, hi, data in list(_sections(blob))[:2]:
        s = ctx.shape
        c, t = s.heads * s.key_dim, s.tokens
        pos = 0
        mu_end = 2 * c
        b_code = np.frombuffer(data, "u1", c, mu_end)
        table = np.frombuffer(data, "u1", c, mu_end + c)
        pos = mu_end + 2 * c
        plan = codec.plan(c, t, table, None)
        lengths = np.frombuffer(data, "<u2", len(plan), pos).astype(int)
        pos += 2 * len(plan)
        # the same symbols, re-quantized by spec/cachegen.md §10.3's rule (binary64, ties to even)
        x = small_real.layers[ctx.layer].keys[:, lo:hi].double().numpy()
        xc = np.ascontiguousarray(x.transpose(0, 2, 1)).reshape(c, t)
        mu = np.frombuffer(data, "<f2", c, 0).astype(np.float64)
        q = np.rint((xc - mu[:, None]) / tables.STEPS[b_code].astype(np.float64)[:, None]).astype(np.int64)
        cb = tables.codebook()
        for runs, n in zip(plan, lengths):
            words = np.frombuffer(data, "<u4", n, pos)
            pos += 4 * n
            ref = reference_encode([(r.gather(q) + tables.RADIX, cb[r.table]) for r in runs])
            assert np.array_equal(ref, words)
            back = reference_decode(words, [(r.size, cb[r.table]) for r in runs])
            assert all(np.array_equal(b - tables.RADIX, r.gather(q)) for b, r in zip(back, runs))
            lanes_checked += 1
    assert lanes_checked >= 6


def test_corrupt_chunks_are_rejected(small_real):
    blob = bytearray(kvcodec.encode(kvcodec.KVCache(small_real.layers[:2]), "cachegen", chunk_tokens=128))
    original = kvcodec.decode(bytes(blob))
    rng = np.random.default_rng(0)
    for pos in rng.choice(len(blob), 300, replace=False):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        try:
            out = kvcodec.decode(bytes(bad))
        except kvcodec.CorruptDataError:
            continue
        assert out.equal(original)


def test_garbage_sections_fail_cleanly(small_real):
    """Bytes that pass no checksum still must not crash, hang or allocate wildly inside the codec."""
    codec = CacheGen()
    header = Header("float16", tuple(small_real.shapes[:1]), (), 256, 1)
    ctx = layer_context(header, 0, (0, 64), torch.device("cpu"))
    good = codec.encode_layer(small_real.layers[0].keys[:, :64], small_real.layers[0].values[:, :64], ctx)
    rng = np.random.default_rng(1)
    for n in (0, 1, 100, len(good) - 1, len(good), len(good) + 7):
        junk = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        try:
            codec.decode_layer(junk, ctx)
        except kvcodec.CorruptDataError:
            pass
    with pytest.raises(kvcodec.CorruptDataError):
        codec.decode_layer(good[:-3], ctx)


@pytest.mark.parametrize("bad", [dict(level=7), dict(level="2"), dict(group=0), dict(lane_channels=300, lane_tokens=300),
                                 dict(profile=3), dict(nosuch=1)])
def test_bad_config_is_invalid_input(bad):
    with pytest.raises(kvcodec.InvalidInputError):
        kvcodec.get_codec("cachegen", **bad)


def test_non_finite_input_is_rejected():
    kv = kvcodec.KVCache([(torch.tensor([[[1.0, float("nan")]]]), torch.ones(1, 1, 2))])
    with pytest.raises(kvcodec.InvalidInputError):
        kvcodec.encode(kv, "cachegen")


def test_codebook_is_symmetric_so_tables_can_be_chosen_from_magnitudes():
    cb = tables.codebook()
    assert np.array_equal(cb[:, :tables.RADIX], cb[:, tables.RADIX + 1:][:, ::-1])


def test_slot_buckets_bound_every_symbol():
    """The decoder's bucket table: a slot's symbol lies in [lut[b], lut[b + 1]] for its bucket b."""
    cum, lut = tables.cumulative(), tables.slot_buckets().astype(np.int64)
    rng = np.random.default_rng(0)
    slots = np.concatenate([rng.integers(0, 1 << 24, 20000), (np.arange(4096) << 12), (np.arange(1, 4097) << 12) - 1])
    for j in range(tables.NUM_TABLES):
        symbol = np.searchsorted(cum[j], slots, side="right") - 1
        b = slots >> (tables.PRECISION - tables.BUCKET_BITS)
        assert (lut[j, b] <= symbol).all() and (symbol <= lut[j, b + 1]).all()
