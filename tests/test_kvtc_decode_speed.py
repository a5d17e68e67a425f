"""kvtc's CPU decode as made faster (issue 36, item 2): the same coefficients as the lane plan gives them, features
within spec/kvtc.md's tolerance of the reconstruction done as the spec writes it (one product per part, in
binary64), the rotary embedding's bits unchanged, the calibration hashed once.  Correctness only: the speed is
bench/cpu_codecs.py's."""

from __future__ import annotations

import dataclasses
import hashlib
from importlib.resources import files

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.chunking import layer_context
from kvcodec.codecs.entropy.lanes import decode_lane
from kvcodec.codecs.entropy.tables import STEPS
from kvcodec.codecs.kvtc import KVTC, Calibration, register_calibration
from kvcodec.codecs.kvtc import calibration as calmod
from kvcodec.positions import Rotary
from kvcodec.tools.kvtc_tolerance import assert_within_kvtc_tolerance

GOLDEN = files("kvcodec.formats") / "golden"
GOLDEN_LAYERS = (0, 1, 15, 29)  # the SmolLM2 layers the golden calibration is of (kvcodec/tools/make_golden.py)


@pytest.fixture(scope="module")
def golden_cal() -> Calibration:
    return register_calibration(Calibration.from_bytes((GOLDEN / "kvtc-calibration.kvtc").read_bytes()))


@pytest.fixture(scope="module")
def chunk(real_kv, golden_cal):
    """300 real SmolLM2 tokens of the golden layers, coded with fine rows and small lanes (several lanes and
    token blocks per part), and its single frame's codec, section and layer contexts."""
    kv = kvcodec.KVCache([(real_kv.layers[l].keys[:, :300], real_kv.layers[l].values[:, :300]) for l in GOLDEN_LAYERS],
                         model=golden_cal.model, rope="post")
    codec = KVTC(level=2, calibration=golden_cal, fine_tokens=3, lane_components=16, lane_tokens=64)
    blob = kvcodec.encode(kv, codec, chunk_tokens=512)
    with kvcodec.open(blob) as r:
        section = r._container.read_frame(0).sections[0]
        ctxs = [layer_context(r.header, l, r.header.local_range(l, 0, 300), torch.device("cpu"), "cpu")
                for l in range(len(GOLDEN_LAYERS))]
    return blob, codec, section, ctxs


def _plan_coefficients(codec: KVTC, part) -> torch.Tensor:
    """A part's coefficients the way the encoder lays its lanes out (``_plan``'s runs, one scatter per run)."""
    q = np.zeros((len(part.table), part.tokens), np.int32)
    offsets = np.concatenate([[0], np.cumsum(part.lengths)])
    for j, runs in enumerate(codec._plan(part.live, part.tokens, part.table)):
        symbols = decode_lane(part.words[offsets[j]:offsets[j + 1]].astype(np.uint32), [(r.size, r.table) for r in runs])
        for r, s in zip(runs, symbols):
            r.scatter(q, s)
    n = part.span
    return torch.from_numpy(q[:n].T.astype(np.float32) * STEPS[part.codes[:n]][None, :])


def test_coefficients_are_those_of_the_lane_plan_bit_for_bit(chunk):
    """The decode plans a part's lanes at once; each coefficient is the one the encoder's per-lane plan puts there."""
    _, codec, section, ctxs = chunk
    blocks = codec.group_blocks(section, ctxs, {c.layer for c in ctxs})
    parts = [p for g, present, block in blocks for p in codec.parse_group(g, present, block)[0]]
    assert len(parts) == 2 * 4  # keys, values and their fine parts, in each of the two groups
    assert any(-(-len(p.live) // 16) > 1 for p in parts) and parts[0].tokens > 64  # several lanes each way
    for part in parts:
        assert torch.equal(codec.coefficients(part), _plan_coefficients(codec, part))


def test_decode_is_within_tolerance_of_a_product_per_part_in_binary64(chunk, golden_cal):
    """One float32 product per side over the fine and normal rows back in place, RoPE batched over the group's
    layers: within spec/kvtc.md's tolerance of the reconstruction as the spec writes it, in binary64."""
    blob, codec, section, ctxs = chunk
    got = kvcodec.decode(blob)
    layers = {}
    for g, present, block in codec.group_blocks(section, ctxs, {c.layer for c in ctxs}):
        parts, sinks, fine = codec.parse_group(g, present, block)
        t, s = present[0].shape.tokens, codec._sinks(present[0])
        sides = []
        for side, gb in enumerate((golden_cal.keys[g], golden_cal.values[g])):
            rows = torch.empty(t - s, gb.basis.shape[0], dtype=torch.float64)
            normal = np.setdiff1d(np.arange(t - s), fine)
            for part, at in zip(parts[side::2], (normal, fine)):
                c = codec.coefficients(part).double()
                rows[torch.from_numpy(at)] = c @ gb.basis[:, :part.span].double().T / gb.weight.double() + gb.mean.double()
            sides.append(rows)
        start = 0
        for c, (sink_k, sink_v) in zip(present, sinks):
            width = c.shape.heads * c.shape.key_dim
            k, v = (x[:, start:start + width].reshape(t - s, c.shape.heads, -1).transpose(0, 1) for x in sides)
            k = golden_cal.layers[c.layer].rotary.rotate(k, c.positions_tensor()[s:])
            layers[c.layer] = tuple(torch.cat([torch.from_numpy(e.astype(np.float32)), x.float()], 1).half()
                                    for e, x in ((sink_k, k), (sink_v, v)))
            start += width
    reference = kvcodec.KVCache([layers[l] for l in sorted(layers)], model=golden_cal.model, rope="post")
    assert_within_kvtc_tolerance(blob, got, reference)


def _textbook_rotate(rot: Rotary, x: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
    """spec/kvtc.md's rotation, every step a new binary64 tensor (Rotary.rotate before it worked in place)."""
    angle = positions.double()[:, None] * torch.from_numpy(rot.inv_freq)[None, :]
    cos, sin, half = angle.cos(), angle.sin(), len(rot.inv_freq)
    xd = x.double()
    a, b, rest = xd[..., :half], xd[..., half:2 * half], xd[..., 2 * half:]
    if inverse:
        ya, yb = (a * cos + b * sin) / rot.scaling, (b * cos - a * sin) / rot.scaling
    else:
        ya, yb = (a * cos - b * sin) * rot.scaling, (b * cos + a * sin) * rot.scaling
    return torch.cat([ya, yb, rest], -1).float()


@pytest.mark.parametrize("scaling", [1.0, 0.7071])
@pytest.mark.parametrize("dims", [64, 32])
def test_rotary_rotate_in_place_keeps_the_textbook_bits(scaling, dims):
    rot = Rotary(10000.0 ** (-np.arange(0, dims, 2, dtype=np.float64) / dims), scaling)
    g = torch.Generator().manual_seed(dims)
    positions = torch.arange(1000, 1040)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = (torch.randn(40, 6, 64, generator=g) * 30).to(dtype).transpose(0, 1)  # strided, as a decode's rows are
        for inverse in (False, True):
            assert torch.equal(rot.rotate(x, positions, inverse), _textbook_rotate(rot, x, positions, inverse))


def test_calibration_digest_is_hashed_once_per_byte_form(golden_cal, monkeypatch):
    """Regression: every lookup of a found calibration hashed its bytes twice (73 MB for SmolLM2, up to a quarter
    of a chunk's decode)."""
    cal = Calibration.from_bytes(golden_cal.to_bytes())
    hashed = []
    real = hashlib.sha256
    monkeypatch.setattr(calmod.hashlib, "sha256", lambda data=b"": hashed.append(len(data)) or real(data))
    first = cal.digest
    assert cal.digest == first == golden_cal.digest and hashed == [len(golden_cal.to_bytes())]
    other = dataclasses.replace(cal, model_digest="f" * 64, _bytes=None)
    assert other.digest != first and len(hashed) == 2
