"""Baseline codecs: ``fp8`` (float8 e4m3), ``zstd`` (lossless) and ``lmcache-cachegen`` (LMCache's CacheGen).

Round trips, exact reference quantizers, determinism, corrupt and truncated input, sizes, and real KV.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import CorruptDataError, InvalidInputError, KVCache, LayerContext
from kvcodec.codecs import lmcache_cachegen as lcg
from kvcodec.codecs.fp8 import FP8_MAX
from kvcodec.formats import v1
from kvcodec.formats.v1 import LayerShape

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BASELINES = ["fp8", "zstd", "lmcache-cachegen"]
ALL32 = {"deep_bins": 32}


def slow(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def random_kv(dtype: torch.dtype, shapes=((2, 13, 4, 6), (1, 5, 3, 3), (3, 13, 8, 2)), seed: int = 0,
              scale: float = 3.0) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    return KVCache([((torch.randn(h, t, dk, generator=gen) * scale).to(dtype),
                     (torch.randn(h, t, dv, generator=gen) * scale).to(dtype)) for h, t, dk, dv in shapes])


def ctx_for(layer: int, num_layers: int, h: int, t: int, dk: int, dv: int, dtype=torch.float16) -> LayerContext:
    return LayerContext(layer, num_layers, LayerShape(h, t, dk, dv), dtype)


def container_overhead(blob: bytes) -> int:
    r = kvcodec.open(blob)
    frames = sum(v1.frame_head_size(e.layer_count) for e in r.chunks)
    index = v1.INDEX_HEAD.size + r.num_chunks * v1.INDEX_ENTRY.size + v1.CHECKSUM.size + v1.FOOTER.size
    return v1.PREAMBLE.size + len(r.header.to_json()) + v1.CHECKSUM.size + frames + index


def sections(kv: KVCache, chunk_tokens: int):
    """(layer, local lo, local hi) of every non-empty section, in file order."""
    for t0 in range(0, kv.num_tokens, chunk_tokens):
        tn = min(chunk_tokens, kv.num_tokens - t0)
        for j, layer in enumerate(kv.layers):
            shift = kv.num_tokens - layer.keys.shape[1]
            lo, hi = max(t0 - shift, 0), max(t0 + tn - shift, 0)
            if hi > lo:
                yield j, lo, hi


# ---------------------------------------------------------------------------------------------- registry, configs


def test_baselines_are_registered_with_defaults():
    ids = kvcodec.list_codecs()
    for cid in BASELINES:
        assert cid in ids
    assert kvcodec.get_codec("fp8").lossless is False and kvcodec.get_codec("fp8").get_config() == {}
    assert kvcodec.get_codec("zstd").lossless is True and kvcodec.get_codec("zstd").get_config() == {"level": 3}
    c = kvcodec.get_codec("lmcache-cachegen")
    assert c.lossless is False
    assert c.get_config() == {"key_bins": 32, "value_bins": 32, "deep_bins": 16,
                              "shallow_key_layers": 10, "shallow_value_layers": 2}
    for codec in (c, kvcodec.get_codec("zstd", level=19), kvcodec.get_codec("lmcache-cachegen", **ALL32)):
        assert type(codec).from_config(codec.get_config()) == codec


@pytest.mark.parametrize("codec_id,config", [
    ("fp8", {"bits": 8}), ("zstd", {"level": 0}), ("zstd", {"level": 23}), ("zstd", {"level": True}),
    ("zstd", {"level": "3"}), ("zstd", {"level": 3.0}), ("zstd", {"lvl": 3}),
    ("lmcache-cachegen", {"key_bins": 31}), ("lmcache-cachegen", {"deep_bins": 2}),
    ("lmcache-cachegen", {"value_bins": 66}), ("lmcache-cachegen", {"shallow_key_layers": -1}),
    ("lmcache-cachegen", {"shallow_value_layers": 1.5}), ("lmcache-cachegen", {"bins": 32}),
])
def test_bad_options_are_rejected(codec_id, config):
    with pytest.raises(InvalidInputError):
        kvcodec.get_codec(codec_id, **config)


def test_config_is_in_the_container():
    kv = random_kv(torch.float16)
    for cid, cfg in (("zstd", {"level": 7}), ("lmcache-cachegen", ALL32), ("fp8", {})):
        info = kvcodec.open(kvcodec.encode(kv, cid, **cfg)).info
        assert info.codec == cid and {k: info.config[k] for k in cfg} == cfg


def test_bins_by_layer_follow_lmcache():
    c = kvcodec.get_codec("lmcache-cachegen")
    assert [c.bins(layer, True) for layer in (0, 9, 10, 29)] == [32, 32, 16, 16]
    assert [c.bins(layer, False) for layer in (0, 1, 2, 29)] == [32, 32, 16, 16]
    assert c.table_bins(30, True) == c.table_bins(30, False) == 32  # 33-entry tables everywhere, as LMCache
    all16 = kvcodec.get_codec("lmcache-cachegen", key_bins=16, value_bins=16)
    assert all16.table_bins(30, True) == 16
    # a model with no deep layers never uses deep_bins
    assert kvcodec.get_codec("lmcache-cachegen", deep_bins=64).table_bins(2, False) == 32
    every32 = kvcodec.get_codec("lmcache-cachegen", **ALL32)
    assert {every32.bins(layer, kind) for layer in range(40) for kind in (True, False)} == {32}


# ---------------------------------------------------------------------------------------------- zstd


def _weird(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Any bit pattern at all: NaN payloads, infinities, subnormals, negative zero."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", [1, 3, 19, -5])
def test_zstd_is_bit_exact_for_every_bit_pattern(dtype, level):
    kv = KVCache([(_weird(dtype, (2, 9, 5), 1), _weird(dtype, (2, 9, 3), 2)),
                  (_weird(dtype, (1, 4, 2), 3), _weird(dtype, (1, 4, 7), 4))])
    blob = kvcodec.encode(kv, "zstd", level=level, chunk_tokens=4)
    out = kvcodec.decode(blob)
    for a, b in zip(out.layers, kv.layers):
        assert torch.equal(a.keys.view(torch.uint8), b.keys.view(torch.uint8))
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
    assert kvcodec.encode(kv, "zstd", level=level, chunk_tokens=4) == blob


@slow(30)
@given(dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31), chunk_tokens=st.integers(1, 20),
       lengths=st.lists(st.integers(0, 20), min_size=1, max_size=3))
def test_zstd_round_trip_with_sliding_window_layers(dtype, seed, chunk_tokens, lengths):
    longest = max(max(lengths), 1)
    lengths = [longest] + lengths
    kv = KVCache([(_weird(dtype, (2, t, 3), seed + i), _weird(dtype, (2, t, 4), seed + 100 + i))
                  for i, t in enumerate(lengths)])
    out = kvcodec.decode(kvcodec.encode(kv, "zstd", chunk_tokens=chunk_tokens))
    for a, b in zip(out.layers, kv.layers):
        assert torch.equal(a.keys.view(torch.uint8), b.keys.view(torch.uint8))
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))


def test_zstd_section_is_one_frame_of_the_raw_bytes():
    k, v = torch.randn(2, 6, 4).half(), torch.randn(2, 6, 3).half()
    ctx = ctx_for(0, 1, 2, 6, 4, 3)
    codec = kvcodec.get_codec("zstd", level=5)
    data = codec.encode_layer(k, v, ctx)
    raw = kvcodec.get_codec("raw").encode_layer(k, v, ctx)
    assert zstandard.ZstdDecompressor().decompress(data) == raw
    params = zstandard.get_frame_parameters(data)
    assert params.content_size == len(raw) and params.dict_id == 0 and not params.has_checksum
    assert data == zstandard.ZstdCompressor(level=5).compress(raw)


def test_zstd_decode_is_bounded_and_strict():
    k, v = torch.zeros(1, 64, 32).half(), torch.zeros(1, 64, 32).half()  # compresses extremely well
    ctx = ctx_for(0, 1, 1, 64, 32, 32)
    codec = kvcodec.get_codec("zstd")
    good = codec.encode_layer(k, v, ctx)
    raw = kvcodec.get_codec("raw").encode_layer(k, v, ctx)
    assert len(good) < 50
    k2, v2 = codec.decode_layer(good, ctx)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    bad = {
        "bigger frame": zstandard.ZstdCompressor().compress(bytes(1 << 24)),  # 16 MiB of zeros, a few hundred bytes
        "smaller frame": zstandard.ZstdCompressor().compress(raw[:-2]),
        "no content size": zstandard.ZstdCompressor(write_content_size=False).compress(raw),
        "trailing bytes": good + b"\x00",
        "two frames": good + good,
        "truncated": good[:-3],
        "empty": b"",
        "garbage": b"not a zstd frame at all",
        "raw bytes": raw,
        "skippable frame first": struct.pack("<II", 0x184D2A50, len(raw)) + bytes(len(raw)) + good,
        "skippable frame after": good + struct.pack("<II", 0x184D2A50, 4) + bytes(4),
    }
    for name, data in bad.items():
        with pytest.raises(CorruptDataError):
            codec.decode_layer(data, ctx)
        assert name


def test_zstd_compresses_structured_data_and_not_noise():
    t = (torch.arange(4096, dtype=torch.float32) % 48).reshape(1, 256, 16)  # a repeating pattern
    kv = KVCache([(t.half(), t.half())])
    assert len(kvcodec.encode(kv, "zstd")) < kv.nbytes / 3
    noise = KVCache([(_weird(torch.float16, (4, 256, 64), 7), _weird(torch.float16, (4, 256, 64), 8))])
    assert len(kvcodec.encode(noise, "zstd")) > 0.99 * noise.nbytes


# ---------------------------------------------------------------------------------------------- fp8


def all_fp8_values() -> torch.Tensor:
    codes = torch.tensor([b for b in range(256) if (b & 0x7F) != 0x7F], dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_equals_torchs_own_e4m3_cast(dtype):
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(2, 40, 8, generator=gen) * s for s in (1e-3, 0.1, 1.0, 30.0, 200.0)]
    k = torch.cat(parts, 1).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    v = (torch.rand(2, 200, 4, generator=gen) * 2 - 1).to(dtype) * 448
    kv = KVCache([(k, v)])
    out = kvcodec.decode(kvcodec.encode(kv, "fp8", chunk_tokens=64))
    assert out.dtype == dtype
    for x, y in ((k, out.layers[0].keys), (v, out.layers[0].values)):
        expected = x.to(torch.float8_e4m3fn).float().to(dtype)
        assert torch.equal(y, expected)
        # the bytes themselves are torch's
        ctx = ctx_for(0, 1, *k.shape, v.shape[2], dtype)
        data = kvcodec.get_codec("fp8").encode_layer(k, v, ctx)
        assert data[:k.numel()] == k.to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_every_finite_value_round_trips_exactly(dtype):
    vals = all_fp8_values()  # 254 values: every e4m3fn byte except the two NaNs
    assert vals.numel() == 254 and float(vals.abs().max()) == FP8_MAX
    x = vals.to(dtype).reshape(1, 127, 2)
    assert torch.equal(x.float(), vals.reshape(1, 127, 2))  # each is exactly a value of dtype
    out = kvcodec.decode(kvcodec.encode(KVCache([(x, x.clone())]), "fp8"))
    assert torch.equal(out.layers[0].keys.view(torch.uint8), x.view(torch.uint8))  # bit for bit, -0 included


@pytest.mark.parametrize("dtype,big", [(torch.float32, 1e30), (torch.float32, 464.0), (torch.float32, 449.0),
                                       (torch.float16, 65504.0), (torch.float16, 500.0), (torch.bfloat16, 3e38),
                                       (torch.bfloat16, 1024.0)])
def test_fp8_saturates_at_448(dtype, big):
    k = torch.tensor([[[big, -big, 448.0, -448.0, 1.0, 0.0]]], dtype=dtype)
    out = kvcodec.decode(kvcodec.encode(KVCache([(k, k.clone())]), "fp8"))
    assert out.layers[0].keys.float().tolist() == [[[448.0, -448.0, 448.0, -448.0, 1.0, 0.0]]]


def test_fp8_keeps_signed_zero_and_subnormals():
    tiny = 2.0**-9  # smallest e4m3fn subnormal
    k = torch.tensor([[[-0.0, 0.0, tiny, -3 * tiny, tiny / 4]]])
    out = kvcodec.decode(kvcodec.encode(KVCache([(k, k.clone())]), "fp8")).layers[0].keys
    assert out.tolist() == [[[-0.0, 0.0, tiny, -3 * tiny, 0.0]]]
    assert torch.signbit(out[0, 0, 0]) and not torch.signbit(out[0, 0, 1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec_id", ["fp8", "lmcache-cachegen"])
def test_lossy_baselines_reject_non_finite_input(bad, dtype, codec_id):
    k, v = torch.zeros(2, 5, 4, dtype=dtype), torch.zeros(2, 5, 4, dtype=dtype)
    v[1, 2, 3] = bad
    with pytest.raises(InvalidInputError):
        kvcodec.encode(KVCache([(k, v)]), codec_id)


def test_fp8_rejects_nan_bytes():
    ctx = ctx_for(0, 1, 1, 2, 2, 2)
    codec = kvcodec.get_codec("fp8")
    good = codec.encode_layer(torch.ones(1, 2, 2), torch.ones(1, 2, 2), ctx)
    for nan in (0x7F, 0xFF):
        with pytest.raises(CorruptDataError):
            codec.decode_layer(good[:5] + bytes([nan]) + good[6:], ctx)
    for n in (0, 7, 9):
        with pytest.raises(CorruptDataError):
            codec.decode_layer(bytes(n), ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_is_one_byte_per_element(dtype):
    kv = random_kv(dtype)
    blob = kvcodec.encode(kv, "fp8", chunk_tokens=4)
    assert len(blob) == kv.num_elements + container_overhead(blob)
    info = kvcodec.open(blob).info
    assert info.bits_per_element == pytest.approx(8 + 8 * container_overhead(blob) / kv.num_elements)


# ---------------------------------------------------------------------------------------------- lmcache-cachegen: exactness


def reference_cachegen(x: torch.Tensor, bins: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """An independent transcription of LMCache's quantizer and dequantizer: symbols [T, C], absmax [T] (float32)
    and the decoded tensor in x's dtype."""
    h, t, d = x.shape
    xf = x.float().permute(1, 0, 2).reshape(t, h * d).numpy()
    amax = np.abs(xf).max(axis=1)
    m = np.float32(bins // 2 - 1)
    q = np.empty_like(xf)
    for i in range(t):
        if amax[i] == 0:
            q[i] = m
        else:
            factor = np.float32(m / amax[i])
            q[i] = np.round(np.float32(xf[i] * factor) + m)  # np.round rounds halves to even
    q = np.clip(q, 0, 2 * m)
    dec = ((q - m) / m * amax[:, None]).astype(np.float32)
    out = torch.from_numpy(dec).to(x.dtype).reshape(t, h, d).permute(1, 0, 2)
    return q.astype(np.int64), amax, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [{}, ALL32, {"key_bins": 8, "value_bins": 4, "deep_bins": 64,
                                                 "shallow_key_layers": 1, "shallow_value_layers": 2}])
def test_lmcache_cachegen_matches_the_reference_quantizer_exactly(dtype, config):
    kv = random_kv(dtype, shapes=((2, 300, 8, 8), (3, 300, 4, 6), (1, 300, 16, 16), (2, 120, 8, 8)), seed=4)
    codec = kvcodec.get_codec("lmcache-cachegen", **config)
    out = kvcodec.decode(kvcodec.encode(kv, codec, chunk_tokens=280))
    for j, (layer, dec) in enumerate(zip(kv.layers, out.layers)):
        for x, y, is_key in ((layer.keys, dec.keys, True), (layer.values, dec.values, False)):
            expected = torch.cat([reference_cachegen(x[:, lo:hi], codec.bins(j, is_key))[2]
                                  for jj, lo, hi in sections(kv, 280) if jj == j], 1)
            assert y.dtype == dtype
            assert torch.equal(y, expected), f"layer {j} {'keys' if is_key else 'values'}"


def _half_step_bound(x: torch.Tensor, bins: int) -> torch.Tensor:
    """Half a quantization step of the token's absmax, plus binary32 and output-dtype rounding."""
    rel = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[x.dtype]
    # below the normal range the output rounds to a fixed spacing (the smallest subnormal), not a relative one
    subnormal = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}[x.dtype]
    amax = x.double().abs().amax(dim=(0, 2), keepdim=True)
    m = bins // 2 - 1
    return amax / (2 * m) + amax * 2.0**-20 + (x.double().abs() + amax / m) * rel + subnormal


@slow(40)
@given(dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31), exponent=st.integers(-6, 3),
       offset=st.sampled_from([0.0, 0.5, -20.0]), tokens=st.integers(1, 40), chunk_tokens=st.integers(1, 40),
       bins=st.sampled_from([4, 16, 32, 64]))
def test_lmcache_cachegen_error_is_within_half_a_step(dtype, seed, exponent, offset, tokens, chunk_tokens, bins):
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0**exponent
    kv = KVCache([((torch.randn(h, tokens, d, generator=gen) * scale + offset).to(dtype),
                   (torch.randn(h, tokens, d + 1, generator=gen) * scale + offset).to(dtype))
                  for h, d in ((1, 3), (2, 5))])
    cfg = {"key_bins": bins, "value_bins": bins, "deep_bins": bins}
    out = kvcodec.decode(kvcodec.encode(kv, "lmcache-cachegen", chunk_tokens=chunk_tokens, **cfg))
    for j, (layer, dec) in enumerate(zip(kv.layers, out.layers)):
        for x, y in ((layer.keys, dec.keys), (layer.values, dec.values)):
            for jj, lo, hi in sections(kv, chunk_tokens):
                if jj == j:
                    xs = x[:, lo:hi]
                    err = (y[:, lo:hi].double() - xs.double()).abs()
                    assert bool((err <= _half_step_bound(xs, bins)).all())


def test_lmcache_cachegen_zero_tokens_and_exact_levels():
    k = torch.zeros(2, 5, 4)
    k[:, 1] = torch.tensor([[-2.0, -1.0, 0.0, 1.0], [2.0, 0.5, 0.25, -0.125]])  # token 1: absmax 2 over both heads
    v = torch.zeros(2, 5, 4)
    v[0, 3, 0] = -7.0
    out = kvcodec.decode(kvcodec.encode(KVCache([(k, v)]), "lmcache-cachegen"))
    assert torch.equal(out.layers[0].values, v)  # all-zero tokens decode to zero (symbol M); ±amax is exact
    assert torch.equal(out.layers[0].keys[:, [0, 2, 3, 4]], k[:, [0, 2, 3, 4]])
    assert float(out.layers[0].keys[0, 1, 2]) == 0.0  # 0 is level M
    assert float(out.layers[0].keys[1, 1, 0]) == 2.0 and float(out.layers[0].keys[0, 1, 0]) == -2.0


def test_lmcache_cachegen_cdf_formula_and_frequencies():
    q = np.array([[0, 1], [0, 1], [2, 1], [0, 3]])  # [T=4, C=2]
    nb = 4
    cdf = lcg.cdf_from_symbols(q, nb)
    a = 65535 - nb
    cum0, cum1 = [0, 3, 3, 4, 4], [0, 0, 3, 3, 4]
    assert cdf.tolist() == [[a * c // 4 + i for i, c in enumerate(cum0)], [a * c // 4 + i for i, c in enumerate(cum1)]]
    assert cdf.dtype == np.uint16 and cdf[:, 0].tolist() == [0, 0] and cdf[:, -1].tolist() == [65535, 65535]
    f = lcg.frequencies(cdf)
    assert f.shape == (2, 4) and f.sum(1).tolist() == [65536, 65536] and f.min() >= 1
    c = cdf.astype(np.int64)
    assert f[0].tolist() == [c[0, 1], c[0, 2] - c[0, 1], c[0, 3] - c[0, 2], 65536 - c[0, 3]]  # 65535 unused
    lcg.check_cdf(cdf, "test")
    rng = np.random.default_rng(0)
    for _ in range(50):
        t, c, nb = int(rng.integers(1, 600)), int(rng.integers(1, 5)), int(rng.choice([16, 32, 64]))
        q = rng.integers(0, nb - 1, (t, c))
        f = lcg.frequencies(lcg.cdf_from_symbols(q, nb))
        assert (f.sum(1) == 65536).all() and (f >= 1).all()
        counts = np.stack([np.bincount(q[:, i], minlength=nb) for i in range(c)])
        assert (np.abs(f - counts * (65535 - nb) / t) <= 2).all()  # proportional to the histogram


def test_coder_uses_exactly_the_16_bit_frequencies():
    """The stream costs exactly the information content under the stored table (plus a few words of flush):
    a rare symbol of frequency 1/65536 costs 16 bits, not what a re-quantized table would give."""
    enc_cls, dec_cls = lcg._RangeEncoder, lcg._RangeDecoder
    rng = np.random.default_rng(1)
    for nb in (16, 32, 64):
        for _ in range(20):
            w = rng.integers(1, 4000, nb)
            f = np.maximum(w * 65535 // w.sum(), 1)
            f[0] = 1  # symbol 0 as rare as a 16-bit table allows: 16 bits each
            f[np.argmax(f)] += 65536 - f.sum()
            assert f.min() >= 1 and f.sum() == 65536
            syms = rng.choice(nb, 300, p=f / 65536).astype(np.int32)
            syms[:40] = 0
            model = lcg.coder_model(f.astype(np.int64))
            enc = enc_cls()
            enc.encode(syms, model)
            words = enc.get_compressed()
            info = float(-np.log2(f[syms] / 65536).sum())
            assert info <= 32 * len(words) <= info + 64
            assert np.array_equal(dec_cls(words).decode(model, len(syms)), syms)


# ---------------------------------------------------------------------------------------------- lmcache-cachegen: sizes


def lmcache_fixed_bytes(h: int, t: int, dk: int, dv: int, e: int, nbk: int, nbv: int) -> int:
    lanes = math.ceil(t / 256) * h * (dk + dv)
    return 2 * t * e + 2 * h * (dk * (nbk + 1) + dv * (nbv + 1)) + 4 * lanes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 255, 256, 257, 600])
def test_lmcache_cachegen_section_layout(dtype, t):
    gen = torch.Generator().manual_seed(t)
    h, dk, dv = 2, 8, 4
    k, v = torch.randn(h, t, dk, generator=gen).to(dtype), torch.randn(h, t, dv, generator=gen).to(dtype)
    codec = kvcodec.get_codec("lmcache-cachegen")
    ctx = LayerContext(12, 30, LayerShape(h, t, dk, dv), dtype)  # a deep layer: 16 bins, 33-entry tables
    data = codec.encode_layer(k, v, ctx)
    e = dtype.itemsize
    fixed = lmcache_fixed_bytes(h, t, dk, dv, e, 32, 32)
    assert codec.fixed_size(ctx) == fixed
    lanes = math.ceil(t / 256) * h * (dk + dv)
    lengths = np.frombuffer(data[fixed - 4 * lanes:fixed], "<u4")
    assert len(data) == fixed + 4 * int(lengths.sum())
    # scales first: each token's absmax over all heads and dims, in the cache dtype
    amax_k = torch.frombuffer(bytearray(data[:t * e]), dtype=dtype)
    assert torch.equal(amax_k, k.abs().amax(dim=(0, 2)))
    amax_v = torch.frombuffer(bytearray(data[t * e:2 * t * e]), dtype=dtype)
    assert torch.equal(amax_v, v.abs().amax(dim=(0, 2)))
    # then the key CDFs [H·Dk, 33], built from the symbols of the reference quantizer
    q, _, _ = reference_cachegen(k, 16)
    cdf_k = np.frombuffer(data[2 * t * e:2 * t * e + 2 * h * dk * 33], "<u2").reshape(h * dk, 33)
    assert np.array_equal(cdf_k, lcg.cdf_from_symbols(q, 32))
    assert q.max() <= 14
    k2, v2 = codec.decode_layer(data, ctx)
    assert k2.shape == k.shape and v2.shape == v.shape


def test_lmcache_cachegen_bits_per_element_formula():
    """Every byte counted: per-token scales 16/C bits, tables 16·33/T bits and lane lengths 32/T bits per
    element (C = H·D channels, T = 256-token chunks), plus the coded symbols and the container."""
    layers, h, t, d = 3, 2, 512, 32
    gen = torch.Generator().manual_seed(0)
    kv = KVCache([(torch.randn(h, t, d, generator=gen).half(), torch.randn(h, t, d, generator=gen).half())
                  for _ in range(layers)])
    blob = kvcodec.encode(kv, "lmcache-cachegen", chunk_tokens=256)
    info = kvcodec.open(blob).info
    c = h * d
    overhead = 16 / c + 16 * 33 / 256 + 32 / 256
    codec = kvcodec.get_codec("lmcache-cachegen")
    symbols = 0.0
    for j, layer in enumerate(kv.layers):
        for x, is_key in ((layer.keys, True), (layer.values, False)):
            for t0 in range(0, t, 256):
                q, _, _ = reference_cachegen(x[:, t0:t0 + 256], codec.bins(j, is_key))
                f = lcg.frequencies(lcg.cdf_from_symbols(q, 32))
                symbols += float(-np.log2(f[np.arange(q.shape[1])[None, :], q] / 65536).sum())
    ideal = overhead + symbols / kv.num_elements
    container = 8 * container_overhead(blob) / kv.num_elements
    lanes = layers * 2 * 2 * c
    # each lane's stream is its information content rounded up to 32-bit words, plus at most 2 words of flush
    assert ideal + container <= info.bits_per_element <= ideal + container + 64 * lanes / kv.num_elements
    assert 16 * 33 / 256 == pytest.approx(2.0625)


# ---------------------------------------------------------------------------------------------- determinism, corruption


@pytest.mark.parametrize("codec_id,config", [("fp8", {}), ("zstd", {}), ("zstd", {"level": 19}),
                                             ("lmcache-cachegen", {}), ("lmcache-cachegen", ALL32)])
def test_encoding_is_deterministic(codec_id, config):
    kv = random_kv(torch.bfloat16, seed=11)
    a = kvcodec.encode(kv, codec_id, chunk_tokens=5, **config)
    b = kvcodec.encode(random_kv(torch.bfloat16, seed=11), codec_id, chunk_tokens=5, **config)
    assert a == b


@pytest.mark.parametrize("codec_id", BASELINES)
def test_flipped_bytes_in_a_container_are_caught(codec_id):
    kv = random_kv(torch.float16, seed=2)
    blob = kvcodec.encode(kv, codec_id, chunk_tokens=6)
    ref = kvcodec.decode(blob)
    rng = np.random.default_rng(0)
    positions = sorted(set(rng.integers(0, len(blob), 150).tolist()) | {0, len(blob) - 1, len(blob) // 2})
    for pos in positions:
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        try:
            out = kvcodec.decode(bytes(bad))
        except CorruptDataError:
            continue
        assert out.equal(ref), f"flip at {pos} changed the data silently"
    for cut in sorted(set(rng.integers(1, len(blob), 40).tolist())):
        with pytest.raises(CorruptDataError):
            kvcodec.decode(blob[:cut])


def _section_cases():
    dtype = torch.float16
    gen = torch.Generator().manual_seed(5)
    h, t, dk, dv = 2, 20, 4, 3
    k, v = (torch.randn(h, t, dk, generator=gen) * 2).to(dtype), torch.randn(h, t, dv, generator=gen).to(dtype)
    return k, v, LayerContext(3, 4, LayerShape(h, t, dk, dv), dtype)


@pytest.mark.parametrize("codec_id", BASELINES)
def test_every_damaged_section_byte_decodes_or_raises_corrupt(codec_id):
    """The codec itself, without the container's checksums: any single damaged byte either still decodes to
    tensors of the right shape, or raises CorruptDataError; never another error, never a hang."""
    k, v, ctx = _section_cases()
    codec = kvcodec.get_codec(codec_id)
    data = codec.encode_layer(k, v, ctx)
    k0, v0 = codec.decode_layer(data, ctx)
    rng = np.random.default_rng(3)
    for pos in range(len(data)):
        for flip in (1 << int(rng.integers(0, 8)), 0xFF):
            bad = bytearray(data)
            bad[pos] ^= flip
            try:
                k1, v1 = codec.decode_layer(bytes(bad), ctx)
            except CorruptDataError:
                continue
            assert k1.shape == k0.shape and v1.shape == v0.shape and k1.dtype == ctx.dtype
    for cut in range(len(data)):
        with pytest.raises(CorruptDataError):
            codec.decode_layer(data[:cut], ctx)
    with pytest.raises(CorruptDataError):
        codec.decode_layer(data + b"\x00\x00\x00\x00", ctx)


def test_lmcache_cachegen_rejects_inconsistent_sections():
    k, v, ctx = _section_cases()
    codec = kvcodec.get_codec("lmcache-cachegen")
    data = bytearray(codec.encode_layer(k, v, ctx))
    t, e, ck, cv = 20, 2, 8, 6
    fixed = codec.fixed_size(ctx)
    cdf_at = 2 * t * e
    len_at = fixed - 4 * (ck + cv)

    def damaged(edit):
        bad = bytearray(data)
        edit(bad)
        return bytes(bad)

    cases = {
        "negative scale": damaged(lambda b: b.__setitem__(1, b[1] | 0x80)),
        "NaN scale": damaged(lambda b: b.__setitem__(slice(0, 2), b"\x00\x7e")),
        "CDF not from 0": damaged(lambda b: b.__setitem__(slice(cdf_at, cdf_at + 2), b"\x01\x00")),
        "CDF not to 65535": damaged(lambda b: b.__setitem__(slice(cdf_at + 64, cdf_at + 66), b"\xfe\xff")),
        "CDF not increasing": damaged(lambda b: b.__setitem__(slice(cdf_at + 2, cdf_at + 4), b"\x00\x00")),
        "lengths off by one": damaged(lambda b: b.__setitem__(len_at, b[len_at] + 1)),
        "lengths swapped": damaged(lambda b: b.__setitem__(slice(len_at, len_at + 8),
                                                           bytes([b[len_at] + 1, 0, 0, 0, b[len_at + 4] - 1, 0, 0, 0]))),
    }
    for name, bad in cases.items():
        with pytest.raises(CorruptDataError):
            codec.decode_layer(bad, ctx)
        assert name
    # a valid stream holding a symbol the layer's bins never produce (31 in a 16-bin layer, codes 0…14)
    deep = LayerContext(20, 30, LayerShape(1, 3, 1, 1), torch.float16)
    sec = codec.encode_layer(torch.ones(1, 3, 1).half(), torch.ones(1, 3, 1).half(), deep)
    fixed = codec.fixed_size(deep)
    cdf = np.arange(33, dtype=np.uint16)
    cdf[-1] = 65535
    f = lcg.frequencies(cdf[None])[0]
    enc = lcg._RangeEncoder()
    enc.encode(np.array([31, 31, 31], np.int32), lcg.coder_model(f))
    words = enc.get_compressed()
    forged = bytearray(sec[:fixed])
    forged[12:12 + 66] = cdf.astype("<u2").tobytes()  # key table, after 2·T·e = 12 bytes of scales
    forged[fixed - 8:fixed - 4] = np.uint32(len(words)).astype("<u4").tobytes()
    value_words = np.frombuffer(sec[fixed:], "<u4")[-int(np.frombuffer(sec[fixed - 4:fixed], "<u4")[0]):]
    forged = bytes(forged) + words.astype("<u4").tobytes() + value_words.astype("<u4").tobytes()
    with pytest.raises(CorruptDataError, match="symbol"):
        codec.decode_layer(forged, deep)


# ---------------------------------------------------------------------------------------------- container paths


@pytest.mark.parametrize("codec_id", BASELINES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_through_every_container_path(codec_id, dtype):
    kv = KVCache([((torch.randn(2, 30, 4) * 4).to(dtype), torch.randn(2, 30, 6).to(dtype)),
                  (torch.randn(1, 7, 3).to(dtype), torch.randn(1, 7, 3).to(dtype))], model="m", rope="post")
    blob = kvcodec.encode(kv, codec_id, chunk_tokens=8)
    full = kvcodec.decode(blob)
    assert full.shapes == kv.shapes and full.dtype == dtype
    streamed = kvcodec.decode(iter([blob[i:i + 97] for i in range(0, len(blob), 97)]))
    assert streamed.equal(full)
    with kvcodec.open(blob) as r:
        part = r.read_chunk(2, layers=[0])
        assert torch.equal(part.layers[0].keys, full.layers[0].keys[:, 16:24])
    if kvcodec.get_codec(codec_id).lossless:
        assert full.equal(kv)


# ---------------------------------------------------------------------------------------------- real KV


def test_zstd_on_real_kv_is_lossless_and_modest(real_kv):
    blob = kvcodec.encode(real_kv, "zstd")
    assert kvcodec.decode(blob).equal(real_kv)
    ratio = real_kv.nbytes / len(blob)
    print(f"zstd level 3 on real float16 SmolLM2 KV: {ratio:.3f}x, "
          f"{8 * len(blob) / real_kv.num_elements:.2f} bits/element")
    assert 1.0 < ratio < 1.35  # float16 mantissas are close to noise: a general compressor gains little


def test_fp8_on_real_kv(real_kv):
    blob = kvcodec.encode(real_kv, "fp8")
    out = kvcodec.decode(blob)
    assert 8.0 < 8 * len(blob) / real_kv.num_elements < 8.01
    for a, b in zip(real_kv.layers, out.layers):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert bool(x.abs().max() < FP8_MAX)  # real KV never saturates: fp8 is torch's cast
            assert torch.equal(y, x.to(torch.float8_e4m3fn).to(torch.float16))
            normal = x.abs() >= 2.0**-6
            rel = ((y.float() - x.float()).abs() / x.float().abs())[normal]
            assert float(rel.max()) <= 2.0**-4 + 1e-3  # 3 mantissa bits: at most half an ulp, 1/16


def test_lmcache_cachegen_on_real_kv(real_kv):
    bpe = {}
    for name, cfg in (("default", {}), ("32 everywhere", ALL32)):
        codec = kvcodec.get_codec("lmcache-cachegen", **cfg)
        blob = kvcodec.encode(real_kv, codec)
        assert kvcodec.encode(real_kv, codec) == blob
        out = kvcodec.decode(blob)
        bpe[name] = 8 * len(blob) / real_kv.num_elements
        for j, (a, b) in enumerate(zip(real_kv.layers, out.layers)):
            for x, y, is_key in ((a.keys, b.keys, True), (a.values, b.values, False)):
                bins = codec.bins(j, is_key)
                for t0 in range(0, real_kv.num_tokens, 256):
                    xs = x[:, t0:t0 + 256]
                    err = (y[:, t0:t0 + 256].double() - xs.double()).abs()
                    assert bool((err <= _half_step_bound(xs, bins)).all()), f"layer {j}"
    print(f"lmcache-cachegen on real KV: {bpe['default']:.3f} bits/element (default), "
          f"{bpe['32 everywhere']:.3f} (32 bins everywhere)")
    # about 2.06 of fixed tables + 0.08 scales + 0.125 lane lengths, plus the symbols' entropy
    assert 4.0 < bpe["default"] < 5.2
    assert bpe["default"] + 0.4 < bpe["32 everywhere"] < 6.2


# ---------------------------------------------------------------------------------------------- the lane stream format


def reference_range_encode(symbols: np.ndarray, freq: np.ndarray) -> list[int]:
    """spec/lmcache-cachegen.md's (§10.6) range coder, transcribed: 64-bit state, 32-bit words, 24-bit precision, frequencies
    ``256·f`` of the 16-bit table, carries resolved by holding back words while ``lower + range`` wraps."""
    mask64, word_max = (1 << 64) - 1, (1 << 32) - 1
    cum = np.concatenate([[0], np.cumsum(freq)]) * 256
    lower, rng, out, held = 0, mask64, [], None  # held: (count, first word) of words awaiting a carry

    def release(carry: bool) -> None:
        n, first = held
        out.extend([first + 1] + [0] * (n - 1) if carry else [first] + [word_max] * (n - 1))

    for s in symbols.tolist():
        scale = rng >> 24
        rng = scale * int(freq[s]) * 256
        new_lower = (lower + scale * int(cum[s])) & mask64
        if held is not None and ((new_lower + rng) & mask64) > new_lower:
            release(new_lower < lower)
            held = None
        lower = new_lower
        if rng < 1 << 32:
            rng <<= 32
            word = lower >> 32
            lower = (lower << 32) & mask64
            if held is not None:
                held = (held[0] + 1, held[1])
            elif ((lower + rng) & mask64) > lower:
                out.append(word)
            else:
                held = (1, word)
    if rng != mask64:  # seal (nothing at all for an empty lane)
        point = (lower + word_max) & mask64
        if held is not None:
            release(point < lower)
        out.append(point >> 32)
        if ((lower + rng) & mask64) >> 32 == point >> 32:
            out.append(0)
    return out


def test_lane_streams_are_the_specified_range_code():
    rng = np.random.default_rng(7)
    for trial in range(60):
        nb = int(rng.choice([4, 16, 32, 64]))
        t = int(rng.integers(1, 257))
        skew = float(rng.choice([0.3, 1.0, 5.0]))
        q = np.clip(np.round(rng.normal(nb / 2 - 1, skew * nb / 16, (t, 3))), 0, nb - 2).astype(np.int32)
        freq = lcg.frequencies(lcg.cdf_from_symbols(q, nb))
        for c in range(3):
            enc = lcg._RangeEncoder()
            enc.encode(q[:, c].copy(), lcg.coder_model(freq[c]))
            assert enc.get_compressed().tolist() == reference_range_encode(q[:, c], freq[c]), f"trial {trial}"
