"""Codecs: the registry (built-ins and entry-point plugins), kivi's error bound, size and input checks."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import Codec, CorruptDataError, InvalidInputError, KVCache, LayerContext, UnknownCodecError
from kvcodec.codecs import bitpack, registry
from kvcodec.codecs.base import expect_size
from kvcodec.formats import v1
from kvcodec.formats.v1 import LayerShape

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def slow(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------- registry


def test_builtin_codecs_are_listed():
    ids = kvcodec.list_codecs()
    assert "raw" in ids and "kivi" in ids
    assert ids == sorted(ids)
    assert kvcodec.get_codec("raw").lossless is True
    assert kvcodec.get_codec("kivi").lossless is False


@pytest.mark.parametrize("codec_id,config", [("raw", {}), ("kivi", {}), ("kivi", {"bits": 2}),
                                             ("kivi", {"bits": 8, "group": 32}), ("kivi", {"group": 1})])
def test_get_codec_from_config_get_config_round_trip(codec_id, config):
    c = kvcodec.get_codec(codec_id, **config)
    assert c.codec_id == codec_id
    cfg = c.get_config()
    assert {k: cfg[k] for k in config} == config
    assert type(c).from_config(cfg) == c
    assert kvcodec.get_codec(codec_id, **cfg) == c
    assert registry.codec_class(codec_id) is type(c)
    assert hash(type(c).from_config(cfg)) == hash(c)
    assert codec_id in repr(c).lower() or type(c).__name__ in repr(c)


def test_kivi_defaults_and_config_in_container():
    assert kvcodec.get_codec("kivi").get_config() == {"bits": 4, "group": 128}
    assert kvcodec.get_codec("kivi", bits=2) != kvcodec.get_codec("kivi", bits=4)
    kv = KVCache([(torch.randn(1, 3, 2), torch.randn(1, 3, 2))])
    info = kvcodec.open(kvcodec.encode(kv, "kivi", bits=8, group=2)).info
    assert (info.codec, info.config) == ("kivi", {"bits": 8, "group": 2})


def test_unknown_ids_and_options_are_named():
    with pytest.raises(UnknownCodecError, match="nosuch"):
        kvcodec.get_codec("nosuch")
    with pytest.raises(InvalidInputError, match="colour"):
        registry.codec_class("kivi").from_config({"bits": 4, "colour": "red"})
    with pytest.raises(InvalidInputError):
        registry.codec_class("raw").from_config({"bits": 4})


def test_register_rejects_non_codecs():
    for thing in (int, object(), "raw", kvcodec.get_codec("raw")):
        with pytest.raises(InvalidInputError):
            kvcodec.register_codec(thing)


class XorCodec(Codec):
    """A tiny lossless third-party codec: the raw bytes xor a key, values before keys."""

    codec_id = "test-xor"
    lossless = True

    def __init__(self, key: int = 0x5A) -> None:
        if not (isinstance(key, int) and 0 <= key < 256):
            raise InvalidInputError(f"key must be a byte, not {key!r}")
        self.key = key

    def get_config(self) -> dict[str, Any]:
        return {"key": self.key}

    @staticmethod
    def _bytes(x: torch.Tensor) -> np.ndarray:
        return x.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1)

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        return (np.concatenate([self._bytes(values), self._bytes(keys)]) ^ np.uint8(self.key)).tobytes()

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        s, item = ctx.shape, ctx.dtype.itemsize
        nv = s.heads * s.tokens * s.value_dim * item
        expect_size(data, nv + s.heads * s.tokens * s.key_dim * item, "test-xor")
        raw = torch.from_numpy(np.frombuffer(data, np.uint8) ^ np.uint8(self.key))
        values = raw[:nv].view(ctx.dtype).reshape(s.heads, s.tokens, s.value_dim)
        keys = raw[nv:].view(ctx.dtype).reshape(s.heads, s.tokens, s.key_dim)
        return keys.to(ctx.device), values.to(ctx.device)


class FakeEntryPoint:
    def __init__(self, name: str, target: Any) -> None:
        self.name, self.target, self.loads = name, target, 0

    def load(self) -> Any:
        self.loads += 1
        if isinstance(self.target, Exception):
            raise self.target
        return self.target


@pytest.fixture
def plugin(monkeypatch):
    """Registry state as if a package declared ``test-xor`` (and a clashing ``raw``) as entry points."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    eps = [FakeEntryPoint("test-xor", XorCodec), FakeEntryPoint("raw", RuntimeError("must not be loaded"))]
    asked = []

    def entry_points(*, group=None, **kw):
        asked.append(group)
        return list(eps) if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry, "entry_points", entry_points)
    return eps, asked


def test_entry_point_codec_is_found_lazily_and_once(plugin):
    eps, asked = plugin
    assert "test-xor" not in registry._registry
    c = kvcodec.get_codec("test-xor", key=7)  # an unknown id makes the registry look at entry points
    assert isinstance(c, XorCodec) and c.get_config() == {"key": 7}
    assert asked == [registry.ENTRY_POINT_GROUP]
    assert "test-xor" in kvcodec.list_codecs() and "raw" in kvcodec.list_codecs()
    with pytest.raises(UnknownCodecError):
        kvcodec.get_codec("nosuch-either")
    assert asked == [registry.ENTRY_POINT_GROUP]  # looked up once
    assert eps[0].loads == 1 and eps[1].loads == 0  # a built-in id is never replaced by a plugin
    assert registry.codec_class("raw").__module__ == "kvcodec.codecs.raw"


def test_entry_point_codec_listed(plugin):
    assert "test-xor" in kvcodec.list_codecs()


def test_entry_point_codec_through_the_container(plugin):
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        kv = KVCache([(torch.randn(2, 11, 3, generator=gen).to(dtype), torch.randn(2, 11, 5, generator=gen).to(dtype)),
                      (torch.randn(1, 4, 3, generator=gen).to(dtype), torch.randn(1, 4, 2, generator=gen).to(dtype))],
                     model="plug")
        blob = kvcodec.encode(kv, "test-xor", key=0x33, chunk_tokens=4)
        assert blob != kvcodec.encode(kv, "raw", chunk_tokens=4)
        info = kvcodec.open(blob).info
        assert (info.codec, info.config) == ("test-xor", {"key": 0x33})
        for out in (kvcodec.decode(blob), kvcodec.decode(iter([blob[:100], blob[100:]]))):
            assert out.equal(kv) and out.meta == kv.meta
        chunk = kvcodec.open(blob).read_chunk(1, layers=[0])
        assert torch.equal(chunk.layers[0].keys, kv.layers[0].keys[:, 4:8])
        assert kvcodec.encode(kv, XorCodec(0x33), chunk_tokens=4) == blob

    # without the plugin, a container that needs it names it
    registry._registry.pop("test-xor")
    with pytest.raises(UnknownCodecError, match="test-xor"):
        kvcodec.decode(blob)
    with pytest.raises(UnknownCodecError, match="test-xor"):
        kvcodec.decode(iter([blob]))


def test_registry_restored_after_plugin_tests():
    assert "test-xor" not in registry._registry


# ---------------------------------------------------------------------------------------------- kivi bound


def _round16(x: torch.Tensor) -> torch.Tensor:
    """Largest rounding error of float16 at |x| (normal or subnormal)."""
    return x.abs() * 2.0**-11 + 2.0**-25


_OUT_ROUND = {torch.float32: (2.0**-24, 1e-45), torch.float16: (2.0**-11, 2.0**-25), torch.bfloat16: (2.0**-8, 1e-38)}


def _bound(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Half a quantization step plus what rounding scale and zero to float16 can add (float64)."""
    n = (1 << bits) - 1
    step = (hi - lo) / n
    return (step / 2 + _round16(step) / 2 + n * _round16(step) + _round16(lo)
            + 2.0**-20 * (lo.abs() + hi.abs() + n * step))


def kivi_bounds(x_keys: torch.Tensor, x_values: torch.Tensor, bits: int, group: int,
                sections: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element error bounds for one layer given the (local) token ranges of its sections: keys are
    quantized per channel over groups of ``group`` tokens counted from the section start, values per token."""
    kb = torch.zeros_like(x_keys)
    for lo_t, hi_t in sections:
        for g0 in range(lo_t, hi_t, group):
            g1 = min(g0 + group, hi_t)
            sl = x_keys[:, g0:g1]
            kb[:, g0:g1] = _bound(sl.amin(1, keepdim=True), sl.amax(1, keepdim=True), bits).expand_as(sl)
    vb = _bound(x_values.amin(2, keepdim=True), x_values.amax(2, keepdim=True), bits).expand_as(x_values)
    return kb, vb


def _local(kv: KVCache, layer: int, t0: int, tn: int) -> tuple[int, int]:
    shift = kv.num_tokens - kv.layers[layer].keys.shape[1]
    return max(t0 - shift, 0), max(t0 + tn - shift, 0)


@st.composite
def quantizable(draw):
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    longest = draw(st.integers(1, 40))
    scale = 10.0 ** draw(st.integers(-4, 3))
    offset = draw(st.sampled_from([0.0, 1.0, -7.5, 100.0]))
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        h, dk, dv = draw(st.integers(1, 4)), draw(st.integers(1, 24)), draw(st.integers(1, 24))
        t = draw(st.one_of(st.just(longest), st.integers(0, longest)))
        layers.append(tuple((torch.randn(h, t, d, generator=gen) * scale + offset).to(dtype) for d in (dk, dv)))
    return KVCache(layers)


@slow(60)
@given(kv=quantizable(), bits=st.sampled_from([2, 4, 8]), group=st.integers(1, 40), chunk_tokens=st.integers(1, 40))
def test_kivi_error_is_within_half_a_step(kv, bits, group, chunk_tokens):
    blob = kvcodec.encode(kv, "kivi", bits=bits, group=group, chunk_tokens=chunk_tokens)
    out = kvcodec.decode(blob)
    assert out.shapes == kv.shapes and out.dtype == kv.dtype
    rel, absolute = _OUT_ROUND[kv.dtype]
    for j, (layer, dec) in enumerate(zip(kv.layers, out.layers)):
        t = layer.keys.shape[1]
        sections = [_local(kv, j, t0, min(chunk_tokens, kv.num_tokens - t0))
                    for t0 in range(0, kv.num_tokens, chunk_tokens)]
        sections = [(a, b) for a, b in sections if b > a]
        assert sum(b - a for a, b in sections) == t
        xk, xv = layer.keys.double(), layer.values.double()
        kb, vb = kivi_bounds(xk, xv, bits, group, sections)
        for x, y, b, what in ((xk, dec.keys.double(), kb, "keys"), (xv, dec.values.double(), vb, "values")):
            if not x.numel():
                continue
            limit = b + (x.abs() + b) * rel + absolute
            err = (y - x).abs()
            worst = int(torch.argmax(err - limit))
            assert bool((err <= limit).all()), (
                f"layer {j} {what}: error {err.reshape(-1)[worst]:.3g} > bound {limit.reshape(-1)[worst]:.3g}")


def test_kivi_two_bits_is_coarse_and_eight_bits_fine():
    """The bound is not vacuous: errors really are of the size of a step."""
    gen = torch.Generator().manual_seed(5)
    kv = KVCache([(torch.randn(4, 64, 32, generator=gen), torch.randn(4, 64, 32, generator=gen))])
    err = {}
    for bits in (2, 4, 8):
        out = kvcodec.decode(kvcodec.encode(kv, "kivi", bits=bits, group=32))
        err[bits] = float((out.layers[0].values - kv.layers[0].values).abs().mean())
    assert err[2] > 2 * err[4] > 4 * err[8] > 0
    spread = float((kv.layers[0].values.amax(2) - kv.layers[0].values.amin(2)).mean())
    assert spread / 3 / 8 < err[2] < spread / 3 / 2  # about a quarter of a 2-bit step on average


# ---------------------------------------------------------------------------------------------- kivi exactness


def _representable(value: float, dtype: torch.dtype) -> bool:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype)) == value


CONSTANTS = [(dtype, value) for dtype in DTYPES
             for value in (0.0, 1.5, -3.25, 0.0999755859375, 65504.0, -65504.0, 2.0**-24, 1000.5, 0.10009765625)
             if _representable(value, dtype) and _representable(value, torch.float16)]


@pytest.mark.parametrize("dtype,value", CONSTANTS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_constant_tensors_decode_exactly(dtype, value, bits):
    c = torch.tensor(value, dtype=dtype)
    kv = KVCache([(torch.full((2, 9, 5), float(c), dtype=dtype), torch.full((2, 9, 3), float(c), dtype=dtype)),
                  (torch.full((1, 4, 2), float(c), dtype=dtype), torch.full((1, 4, 2), float(c), dtype=dtype))])
    out = kvcodec.decode(kvcodec.encode(kv, "kivi", bits=bits, group=4, chunk_tokens=5))
    for a, b in zip(out.layers, kv.layers):
        assert a.keys.dtype == dtype
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kivi_quantizes_keys_per_channel_and_values_per_token(dtype):
    """Keys constant along tokens (any value per channel) and values constant along channels (any value
    per token) have a zero-width range on kivi's axes, so they decode exactly even at 2 bits."""
    gen = torch.Generator().manual_seed(9)
    h, t, d = 3, 23, 16
    per_channel = (torch.randn(h, 1, d, generator=gen) * 5).to(torch.float16).to(dtype).expand(h, t, d).contiguous()
    per_token = (torch.randn(h, t, 1, generator=gen) * 5).to(torch.float16).to(dtype).expand(h, t, d).contiguous()
    kv = KVCache([(per_channel, per_token)])
    out = kvcodec.decode(kvcodec.encode(kv, "kivi", bits=2, group=8, chunk_tokens=10))
    assert torch.equal(out.layers[0].keys, per_channel)
    assert torch.equal(out.layers[0].values, per_token)
    # the transposed pattern is not on kivi's axes: 2 bits cannot hold 16 different values exactly
    swapped = KVCache([(per_token, per_channel)])
    out = kvcodec.decode(kvcodec.encode(swapped, "kivi", bits=2, group=8, chunk_tokens=10))
    assert not torch.equal(out.layers[0].keys, per_token)
    assert not torch.equal(out.layers[0].values, per_channel)


# ---------------------------------------------------------------------------------------------- kivi input


@pytest.mark.parametrize("where", ["keys", "values"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kivi_rejects_non_finite_input(where, bad, dtype):
    k, v = torch.zeros(2, 5, 4, dtype=dtype), torch.zeros(2, 5, 4, dtype=dtype)
    (k if where == "keys" else v)[1, 3, 2] = bad
    with pytest.raises(InvalidInputError):
        kvcodec.encode(KVCache([(k, v)]), "kivi", bits=4)
    # raw stores it as it is
    assert kvcodec.decode(kvcodec.encode(KVCache([(k, v)]), "raw")).equal(KVCache([(k, v)]))


@pytest.mark.parametrize("bad", [70000.0, -70000.0, 1e30, 65520.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["keys", "values"])
def test_kivi_rejects_values_beyond_float16_range(bad, dtype, where):
    k, v = torch.randn(2, 5, 4).to(dtype), torch.randn(2, 5, 4).to(dtype)
    (k if where == "keys" else v)[0, 4, 1] = bad
    assert float((k if where == "keys" else v)[0, 4, 1]) != float(torch.tensor(bad).half())  # really out of range
    with pytest.raises(InvalidInputError):
        kvcodec.encode(KVCache([(k, v)]), "kivi", bits=8)


def test_kivi_accepts_the_float16_extremes():
    k = torch.tensor([[[-65504.0, 0.0]], [[0.0, 65504.0]]])  # [2, 1, 2]: spreads of 65504 on both axes
    kv = KVCache([(k, k.clone())])
    out = kvcodec.decode(kvcodec.encode(kv, "kivi", bits=8))
    assert torch.equal(out.layers[0].keys, k)  # one token per group: constant per channel
    assert torch.isfinite(out.layers[0].values).all()
    assert float((out.layers[0].values - k).abs().max()) <= 65504 / 255  # within one 8-bit step


# ---------------------------------------------------------------------------------------------- sizes


def _container_overhead(blob: bytes) -> int:
    r = kvcodec.open(blob)
    header = len(r.header.to_json())
    frames = sum(v1.frame_head_size(e.layer_count) for e in r.chunks)
    index = v1.INDEX_HEAD.size + r.num_chunks * v1.INDEX_ENTRY.size + v1.CHECKSUM.size + v1.FOOTER.size
    return v1.PREAMBLE.size + header + v1.CHECKSUM.size + frames + index


def kivi_section_bytes(h: int, t: int, dk: int, dv: int, bits: int, group: int) -> int:
    codes = math.ceil(h * t * dk * bits / 8) + math.ceil(h * t * dv * bits / 8)
    key_params = 2 * 2 * h * math.ceil(t / group) * dk  # float16 scale and zero per channel and group
    value_params = 2 * 2 * h * t  # float16 scale and zero per token
    return codes + key_params + value_params


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_bits_per_element_matches_the_formula(bits):
    layers, h, t, d, group = 2, 4, 256, 64, 128
    gen = torch.Generator().manual_seed(0)
    kv = KVCache([(torch.randn(h, t, d, generator=gen).half(), torch.randn(h, t, d, generator=gen).half())
                  for _ in range(layers)])
    blob = kvcodec.encode(kv, "kivi", bits=bits, group=group, chunk_tokens=256)
    info = kvcodec.open(blob).info
    body = layers * kivi_section_bytes(h, t, d, d, bits, group)
    assert len(blob) == body + _container_overhead(blob)
    assert _container_overhead(blob) < 600
    formula = bits + 16 * math.ceil(t / group) / t + 16 / d  # codes + fp16 key (scale, zero) + fp16 value ones
    assert info.num_elements == layers * h * t * 2 * d
    assert formula <= info.bits_per_element < formula + 0.02
    assert info.bits_per_element == 8 * len(blob) / info.num_elements
    assert info.to_dict()["ratio"] == pytest.approx(info.raw_bytes / len(blob))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [1, 3, 128])
def test_kivi_sizes_for_odd_shapes_and_chunks(bits, group):
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, 7, 5, 3), (1, 2, 1, 9), (2, 7, 2, 2)]
    kv = KVCache([(torch.randn(h, t, dk, generator=gen), torch.randn(h, t, dv, generator=gen)) for h, t, dk, dv in shapes])
    chunk_tokens = 3
    blob = kvcodec.encode(kv, "kivi", bits=bits, group=group, chunk_tokens=chunk_tokens, chunk_layers=2)
    body = 0
    for j, (h, t, dk, dv) in enumerate(shapes):
        for t0 in range(0, kv.num_tokens, chunk_tokens):
            lo, hi = _local(kv, j, t0, min(chunk_tokens, kv.num_tokens - t0))
            if hi > lo:
                body += kivi_section_bytes(h, hi - lo, dk, dv, bits, group)
    assert len(blob) == body + _container_overhead(blob)


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_size_is_the_tensor_bytes(dtype):
    kv = KVCache([(torch.zeros(3, 10, 7, dtype=dtype), torch.zeros(3, 10, 2, dtype=dtype)),
                  (torch.zeros(2, 4, 5, dtype=dtype), torch.zeros(2, 4, 5, dtype=dtype))])
    blob = kvcodec.encode(kv, "raw", chunk_tokens=4)
    assert len(blob) == kv.nbytes + _container_overhead(blob)
    assert kv.nbytes == (3 * 10 * 9 + 2 * 4 * 10) * dtype.itemsize


# ---------------------------------------------------------------------------------------------- codec level


@pytest.mark.parametrize("codec", [kvcodec.get_codec("raw"), kvcodec.get_codec("kivi", bits=2, group=3),
                                   kvcodec.get_codec("kivi", bits=4), kvcodec.get_codec("kivi", bits=8, group=2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_layer_rejects_sections_of_the_wrong_size(codec, dtype):
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 7, 5, generator=gen).to(dtype), torch.randn(2, 7, 3, generator=gen).to(dtype)
    ctx = LayerContext(0, 1, LayerShape(2, 7, 5, 3), dtype)
    data = codec.encode_layer(k, v, ctx)
    keys, values = codec.decode_layer(data, ctx)
    assert keys.shape == k.shape and values.shape == v.shape and keys.dtype == dtype
    for bad in (data[:-1], data + b"\x00", b"", data[: len(data) // 2]):
        with pytest.raises(CorruptDataError):
            codec.decode_layer(bad, ctx)
    other = LayerContext(0, 1, LayerShape(2, 6, 5, 3), dtype)
    with pytest.raises(CorruptDataError):
        codec.decode_layer(data, other)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bitpack_round_trip(bits):
    rng = np.random.default_rng(bits)
    for count in (0, 1, 2, 3, 5, 7, 8, 9, 33, 100):
        codes = rng.integers(0, 1 << bits, count, dtype=np.uint8)
        packed = bitpack.pack(codes, bits)
        assert len(packed) == bitpack.packed_size(count, bits) == math.ceil(count * bits / 8)
        assert np.array_equal(bitpack.unpack(packed, bits, count), codes)
    # least significant bits first
    if bits == 2:
        assert bitpack.pack(np.array([1, 2, 3, 0], np.uint8), 2) == bytes([0b00111001])
