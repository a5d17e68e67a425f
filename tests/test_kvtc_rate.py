"""kvtc's rate control (``kvtc:bits=B``): each chunk gets the rate asked on text its calibration never saw, the
spec's forms and bad values, out-of-reach rates reported by ``kvcodec info``, a store's variants of known size."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec.cli import main
from kvcodec.codecs.entropy.sections import SectionBytes
from kvcodec.codecs.kvtc import KVTC, Calibration, register_calibration
from kvcodec.codecs.kvtc.calibration import LayerInfo
from kvcodec.positions import Rotary
from kvcodec.codecs.registry import codec_from_spec, parse_spec
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.formats.v1 import INDEX_ENTRY
from kvcodec.store import KVStore, MemoryTier
from kvcodec.codecs.kvtc.fit import fit_calibration

LAYERS = (0, 1, 15, 29)  # a slice of SmolLM2's 30 layers keeps the fit and the encodes short
MODEL = "SmolLM2-135M-Instruct/layers-0-1-15-29"
ROPE_THETA = 100000.0  # SmolLM2-135M's
CALIBRATION_TEXT = "license:Apache-2.0"  # one of kvtc's calibration texts; the caches below are evaluation texts
TOLERANCE = 0.02  # per chunk; the bound is 5%


def _slice(kv: kvcodec.KVCache) -> kvcodec.KVCache:
    return kvcodec.KVCache([(kv.layers[i].keys, kv.layers[i].values) for i in LAYERS], model=MODEL, rope=kv.rope)


@pytest.fixture(scope="module")
def calibration(real_dump):
    """A calibration of the four layers fitted on a calibration text, with one weight per layer (a tenth of its
    RMS per step, roughly what calibrated weights do), as kvcodec/formats/golden's is made."""
    src = kvcodec.KVCache.load_safetensors(real_dump(CALIBRATION_TEXT, 512))
    h, t, d = src.layers[0].keys.shape
    rot = Rotary(ROPE_THETA ** (-np.arange(0, d, 2, dtype=np.float64) / d))
    keys = [rot.rotate(src.layers[i].keys.float(), torch.arange(t), inverse=True) for i in LAYERS]
    flat = [x.permute(1, 0, 2).reshape(t, -1) for x in keys + [src.layers[i].values.float() for i in LAYERS]]
    weights = [torch.full((h * d,), 10 / float(x.pow(2).mean().sqrt())) for x in flat]
    cal = fit_calibration(MODEL, [LayerInfo(h, d, d, rot) for _ in LAYERS], [[0, 1], [2, 3]], flat[:4], flat[4:],
                          weights[:4], weights[4:], (0.2, 0.6))
    return register_calibration(cal)


@pytest.fixture(scope="module")
def held_out(real_dump, real_kv):
    """Caches of two evaluation texts (the calibration saw neither)."""
    return [_slice(real_kv), _slice(kvcodec.KVCache.load_safetensors(real_dump("pydoc-topics", 300)))]


def _chunk_rates(blob: bytes) -> list[float]:
    """Each chunk's rate: its frame and index entry over its elements (what kvtc controls)."""
    with kvcodec.open(blob) as r:
        per_token = sum(s.heads * (s.key_dim + s.value_dim) for s in r.info.layers)
        return [8 * (c.length + INDEX_ENTRY.size) / (c.token_count * per_token) for c in r.chunks]


@pytest.mark.parametrize("bits", [0.3, 1.0, 2.5])
def test_each_chunk_gets_the_rate_asked_on_held_out_text(calibration, held_out, bits):
    for kv in held_out:
        blob = kvcodec.encode(kv, KVTC(bits=bits, calibration=calibration), chunk_tokens=128)
        rates = _chunk_rates(blob)
        assert len(rates) >= 3 and all(abs(r / bits - 1) < TOLERANCE for r in rates), rates
        out = kvcodec.decode(blob)
        assert out.shapes == kv.shapes and all(torch.isfinite(l.keys).all() for l in out.layers)


def _relative_error(kv: kvcodec.KVCache, out: kvcodec.KVCache) -> float:
    return float(sum((a.values.float() - b.values.float()).pow(2).sum() + (a.keys.float() - b.keys.float()).pow(2).sum()
                     for a, b in zip(kv.layers, out.layers)) / sum(a.values.float().pow(2).sum() + a.keys.float().pow(2).sum()
                                                                   for a in kv.layers))


def test_more_bits_never_cost_quality(calibration, held_out):
    kv = held_out[1]  # 300 tokens in two chunks: the first one's exact sink token (3 KB) leaves room from 0.3 bits

    # an inner test, so that hypothesis reports the rates it drew and not the fixtures' reprs
    @settings(max_examples=5, deadline=None, derandomize=True)
    @given(low=st.floats(0.3, 2.0), more=st.floats(1.5, 3.0))
    def check(low, more):
        errors = []
        for bits in (low, low * more):
            blob = kvcodec.encode(kv, KVTC(bits=bits, calibration=calibration), chunk_tokens=150)
            assert all(abs(r / bits - 1) < TOLERANCE for r in _chunk_rates(blob))
            errors.append(_relative_error(kv, kvcodec.decode(blob)))
        assert errors[1] < errors[0]

    check()


def test_a_rate_is_a_number_and_not_a_level(calibration):
    assert parse_spec("kvtc:bits=.5") == ("kvtc", {"bits": 0.5}) and parse_spec("kvtc:bits=1") == ("kvtc", {"bits": 1})
    assert codec_from_spec("kvtc:bits=1").get_config() == codec_from_spec("kvtc:bits=1.0").get_config()
    config = KVTC(bits=0.75, calibration=calibration).get_config()
    assert config["bits"] == 0.75 and "level" not in config
    assert KVTC.from_file_config(config).get_config() == config
    for bad in (0, -1, float("nan"), float("inf"), 16.5, "half", True, [1]):
        with pytest.raises(InvalidInputError, match="bits"):
            KVTC(bits=bad)
    with pytest.raises(InvalidInputError, match="not both"):
        codec_from_spec("kvtc:bits=0.5,level=2")
    assert KVTC(bits=1, calibration=calibration).coded_components() == [(b.components, c.components) for b, c in
                                                                         zip(calibration.keys, calibration.values)]


def test_info_reports_asked_achieved_and_rates_out_of_reach(calibration, held_out, tmp_path, capsys):
    kv = held_out[0]
    for bits, reach in ((0.5, True), (0.002, False), (16, False)):  # the sink token alone; every component coded
        path = tmp_path / f"{bits}.kvc"
        path.write_bytes(kvcodec.encode(kv, KVTC(bits=bits, calibration=calibration), chunk_tokens=128))
        assert main(["info", str(path), "--json"]) == 0
        rate = json.loads(capsys.readouterr().out)["rate"]["0"]
        assert rate["asked"] == bits and rate["achieved"] == pytest.approx(8 * path.stat().st_size / kv.num_elements)
        assert (rate["chunks_out_of_reach"] == 0) == reach
        assert main(["info", str(path)]) == 0
        assert f"asked {bits:g} bits/element" in capsys.readouterr().out


def test_a_part_naming_more_components_than_its_basis_is_corrupt(calibration):
    codec = KVTC(bits=1, calibration=calibration)
    gb = calibration.keys[0]
    head = struct.pack("<BBI", 120, 119, gb.components + 1)
    with pytest.raises(CorruptDataError, match="leading components"):
        codec._parse_part(SectionBytes(memoryview(head + bytes(64))), gb, None, 10)


def test_store_variants_of_known_size(calibration, held_out):
    kv, ids = held_out[0], list(range(held_out[0].num_tokens))
    store = KVStore([MemoryTier(None)], model=MODEL, codec=["kvtc:bits=0.5", "kvtc:bits=1", "cachegen", "raw"],
                    chunk_tokens=256)
    assert store.put(ids, kv) == 2
    keys = store.variant_keys(ids)
    assert all(len(set(k)) == 4 for _, _, k in keys)
    elements = kv.num_elements / 2
    for _, _, k in keys:
        sizes = [n for n, _ in store.source.value_sizes(k)]
        # a stored chunk is a whole sealed container: its header (config, shapes, the key) and seal, about 1.5 KB
        # here, come on top of the chunk's rate
        for bits, size in zip((0.5, 1.0), sizes):
            assert bits * elements / 8 * (1 - TOLERANCE) <= size <= bits * elements / 8 + 2048
        assert sizes == sorted(sizes) and len(set(sizes)) == 4
    loaded = store.get(ids)
    assert loaded is not None and loaded.num_tokens == len(ids)


def test_a_rate_file_decodes_alike_on_the_device_path():
    """Rate mode's parts (their own step codes, leading components on another) through the Triton lane decoder
    (its interpreter here) and the device transform, against the CPU decode, on the golden real cache."""
    pytest.importorskip("triton")
    from kvcodec.tools.kvtc_tolerance import assert_within_kvtc_tolerance
    from test_kvtc_triton import GOLDEN, SMALL_LANES, _assert_lanes_equal, _frames

    cal = register_calibration(Calibration.from_bytes((GOLDEN / "kvtc-calibration.kvtc").read_bytes()))
    kv = kvcodec.decode((GOLDEN / "raw-f16.kvc").read_bytes())
    blob = kvcodec.encode(kv, KVTC(bits=2.4, calibration=cal, **SMALL_LANES), chunk_tokens=24)
    parts = [p for codec, data, ctxs in _frames(blob, "cpu")
             for g, present, block in codec.group_blocks(data, ctxs, {c.layer for c in ctxs})
             for p in codec.parse_group(g, present, block)[0]]
    assert any(len(set(p.codes[p.live].tolist())) > 1 for p in parts)  # a part with leading components on `lead`
    assert _assert_lanes_equal(blob) == len(parts) == 2 * 2 * 4  # and their fine parts
    assert_within_kvtc_tolerance(blob, kvcodec.decode(blob, backend="triton"), kvcodec.decode(blob, backend="cpu"))
