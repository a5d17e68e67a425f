"""kvtc's device decode (kvcodec/codecs/kvtc/gpu.py) against its CPU decode, on real SmolLM2 KV.

Without a GPU the lanes run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and the transform
in torch on the CPU, so the lanes are short (8 components by 8 tokens: the interpreter's time grows with the
symbols per lane).  The lanes must equal the CPU's bit for bit; the decoded tensors must be within spec/kvtc.md's
decoding tolerance of the CPU decode (on a GPU the product's sums run in another order), with the sink tokens
exact.  The golden calibration (kvcodec/formats/golden, fitted on real SmolLM2 KV) codes the golden file's real cache.
"""

from __future__ import annotations

from dataclasses import replace
from importlib.resources import files

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import kvcodec  # noqa: E402
from kvcodec.chunking import layer_context  # noqa: E402
from kvcodec.codecs.kvtc import KVTC, Calibration, gpu, register_calibration  # noqa: E402
from kvcodec.layouts.paged import empty_shape, paged_layout, read_paged, slot_mapping  # noqa: E402
from kvcodec.tools.fuzz.seeds import fuzz_calibration  # noqa: E402
from kvcodec.tools.kvtc_tolerance import assert_within_kvtc_tolerance  # noqa: E402

GOLDEN = files("kvcodec.formats") / "golden"
SMALL_LANES = dict(lane_components=8, lane_tokens=8)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def golden():
    """The golden file's real cache (4 SmolLM2 layers, 40 tokens) and the real calibration fitted for it."""
    cal = register_calibration(Calibration.from_bytes((GOLDEN / "kvtc-calibration.kvtc").read_bytes()))
    return kvcodec.decode((GOLDEN / "raw-f16.kvc").read_bytes()), cal


def _frames(blob: bytes, backend: str):
    """Per frame of a kvtc container: its codec, joint section and the contexts of its layers."""
    with kvcodec.open(blob) as r:
        for i in range(r.num_chunks):
            frame = r._container.read_frame(i)
            e = frame.entry
            ctxs = [layer_context(r.header, l, r.header.local_range(l, e.token_start, e.token_count), CPU, backend)
                    for l in sorted(frame.sections)]
            yield r.codecs[e.variant], frame.sections[min(frame.sections)], ctxs


def _assert_lanes_equal(blob: bytes) -> int:
    """The kernel's coefficients of every part of every frame equal the CPU lane decode's; returns the parts."""
    count = 0
    for codec, data, ctxs in _frames(blob, "triton"):
        parts = [p for g, present, block in codec.group_blocks(data, ctxs, {c.layer for c in ctxs})
                 for p in codec.parse_group(g, present, block)[0]]
        launch = gpu.CoefficientLaunch(codec, parts, CPU)
        launch.run()
        for part, got in zip(parts, launch.coefficients):
            assert torch.equal(got, codec.coefficients(part))
        count += len(parts)
    return count


@pytest.mark.parametrize("level", [0, 4])
def test_lanes_are_bit_exact_and_the_decode_within_tolerance(golden, level):
    kv, cal = golden
    blob = kvcodec.encode(kv, KVTC(level=level, calibration=cal, **SMALL_LANES), chunk_tokens=24)
    # two chunks of two groups of keys and values, and their fine parts
    assert _assert_lanes_equal(blob) == 2 * 2 * 4
    reference = kvcodec.decode(blob, backend="cpu")
    got = kvcodec.decode(blob, backend="triton")
    assert got.shapes == reference.shapes and got.dtype == reference.dtype
    assert_within_kvtc_tolerance(blob, got, reference)
    for a, b in zip(got.layers, reference.layers):
        assert torch.equal(a.keys[:, :1], b.keys[:, :1]) and torch.equal(a.values[:, :1], b.values[:, :1])
    # a layer alone: only its columns are multiplied
    one = kvcodec.decode(blob, layers=[3], backend="triton")
    assert torch.equal(one.layers[0].keys, got.layers[3].keys) and torch.equal(one.layers[0].values, got.layers[3].values)


@settings(max_examples=5, deadline=None)
@given(layer=st.integers(0, 28), start=st.integers(0, 400), tokens=st.integers(1, 40), level=st.integers(0, 4),
       lane_components=st.integers(1, 12), lane_tokens=st.integers(1, 12), sink_tokens=st.integers(0, 3),
       min_std=st.sampled_from([0.0, 0.2]), rope=st.sampled_from(["post", "pre"]), shift=st.integers(0, 4000),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), fine_tokens=st.integers(0, 4),
       fine_octaves=st.integers(1, 4))
@example(layer=0, start=0, tokens=1, level=0, lane_components=1, lane_tokens=1, sink_tokens=1, min_std=0.0,
         rope="post", shift=0, dtype=torch.float16, fine_tokens=3, fine_octaves=2)  # a chunk of sink tokens only
@example(layer=0, start=0, tokens=3, level=4, lane_components=1, lane_tokens=1, sink_tokens=0, min_std=0.2,
         rope="post", shift=0, dtype=torch.float16, fine_tokens=4, fine_octaves=4)  # every row fine
def test_any_real_slice_decodes_alike(real_kv, layer, start, tokens, level, lane_components, lane_tokens, sink_tokens,
                                      min_std, rope, shift, dtype, fine_tokens, fine_octaves):
    """Two real layers (one calibration group, fitted on them), any window, lane geometry, level, dtype and
    positions (the keys are rotated back and forth at them)."""
    kv = kvcodec.KVCache([(l.keys[:, start:start + tokens].to(dtype), l.values[:, start:start + tokens].to(dtype))
                          for l in real_kv.layers[layer:layer + 2]], model=real_kv.model, rope=rope,
                         positions=list(range(shift, shift + tokens)))
    codec = KVTC(level=level, calibration=fuzz_calibration(kv), sink_tokens=sink_tokens, min_std=min_std,
                 lane_components=lane_components, lane_tokens=lane_tokens, fine_tokens=fine_tokens,
                 fine_octaves=fine_octaves)
    blob = kvcodec.encode(kv, codec)
    _assert_lanes_equal(blob)
    reference, got = kvcodec.decode(blob, backend="cpu"), kvcodec.decode(blob, backend="triton")
    for a, b in zip(got.layers, reference.layers):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype == dtype and x.shape == y.shape
            s = min(sink_tokens, tokens)
            assert torch.equal(x[:, :s], y[:, :s])
            # the golden tolerance needs a calibration with positions at 0..T-1; here: float32 rounding of the
            # features (|features| < 100, at most 2 * 64 components), then the dtype's own rounding
            assert torch.allclose(x.float(), y.float(), rtol=2 ** -7 if dtype != torch.float32 else 1e-5, atol=1e-3)


def _paged(blob: bytes, backend: str, layout: str, layers: int, table: torch.Tensor, fill: float,
           per_layer: bool = False) -> list[torch.Tensor]:
    """Every frame of ``blob`` decoded into fresh paged tensors through ``table`` (blocks of 16)."""
    paged = [torch.full(empty_shape(layout, 9, 16, 3, 64), fill, dtype=torch.float16) for _ in range(layers)]
    for codec, data, ctxs in _frames(blob, backend):
        slots = {c.layer: slot_mapping(table, c.token_start, c.shape.tokens, 16) for c in ctxs}
        if per_layer:
            (c,) = ctxs
            codec.decode_layer_paged(data, c, paged[c.layer], slots[c.layer], layout)
        else:
            codec.decode_frame_paged(data, ctxs, {l: paged[l] for l in slots}, slots, layout)
    return paged


@pytest.mark.parametrize("layout", ["flash", "gpu", "cpu"])
def test_paged_decode_into_each_layout(golden, layout):
    """Straight into scattered paged blocks of each layout, through a shuffled block table: what the contiguous
    decode gives (within tolerance on the device path, exactly on the CPU path); other slots untouched."""
    kv, cal = golden
    blob = kvcodec.encode(kv, KVTC(level=2, calibration=cal, **SMALL_LANES), chunk_tokens=24)
    table = torch.tensor([7, 2, 5], dtype=torch.int32)
    slots = slot_mapping(table, 0, 40, 16)
    reference = kvcodec.decode(blob, backend="cpu")
    for backend in ("triton", "cpu"):
        paged = _paged(blob, backend, layout, kv.num_layers, table, float("nan"))
        got = kvcodec.KVCache([read_paged(p, slots, layout) for p in paged], model=kv.model, rope="post")
        if backend == "cpu":
            assert got.equal(reference)
        else:
            assert_within_kvtc_tolerance(blob, got, reference)
        untouched = torch.ones(9 * 16, dtype=torch.bool)
        untouched[slots] = False
        for p in paged:
            for view in paged_layout(layout).views(p):
                assert view.reshape(9 * 16, -1)[untouched].isnan().all()


def test_decode_layer_paged_on_a_one_layer_group(real_kv):
    """``decode_layer_paged`` decodes a frame of one layer (a calibration whose groups are single layers)."""
    kv = kvcodec.KVCache([(real_kv.layers[5].keys[:, :40], real_kv.layers[5].values[:, :40])], model=real_kv.model)
    blob = kvcodec.encode(kv, KVTC(calibration=fuzz_calibration(kv), **SMALL_LANES), chunk_tokens=24)
    table = torch.tensor([4, 0, 8], dtype=torch.int32)
    reference = kvcodec.decode(blob, backend="cpu")
    paged = _paged(blob, "triton", "flash", 1, table, 0.0, per_layer=True)
    keys, values = read_paged(paged[0], slot_mapping(table, 0, 40, 16), "flash")
    assert torch.allclose(keys.float(), reference.layers[0].keys.float(), rtol=2 ** -10, atol=1e-3)
    assert torch.allclose(values.float(), reference.layers[0].values.float(), rtol=2 ** -10, atol=1e-3)


def test_paged_decode_refuses_what_does_not_fit(golden):
    kv, cal = golden
    blob = kvcodec.encode(kv, KVTC(calibration=cal, **SMALL_LANES), chunk_tokens=24)
    codec, data, ctxs = next(_frames(blob, "triton"))
    paged = torch.zeros(empty_shape("flash", 4, 16, 3, 64), dtype=torch.float16)
    slots = slot_mapping(torch.arange(2), 0, 24, 16)
    with pytest.raises(kvcodec.InvalidInputError, match="same layers"):
        codec.decode_frame_paged(data, ctxs, {0: paged}, {1: slots})
    with pytest.raises(kvcodec.InvalidInputError, match="same layers"):
        codec.decode_frame_paged(data, ctxs, {9: paged}, {9: slots})
    with pytest.raises(kvcodec.InvalidInputError, match="slots"):
        codec.decode_frame_paged(data, ctxs, {0: paged}, {0: slots[:5]})
    with pytest.raises(kvcodec.InvalidInputError, match="together"):  # one layer of a two-layer group
        codec.decode_layer_paged(data, ctxs[0], paged, slots)


def test_damaged_sections_fail_alike(golden):
    """ANS carries no redundancy: a flipped bit may decode to other symbols or make a lane invalid.  The device
    path must refuse what the CPU path refuses and decode the rest alike."""
    kv, cal = golden
    blob = kvcodec.encode(kvcodec.KVCache([(l.keys[:, :16], l.values[:, :16]) for l in kv.layers], model=kv.model,
                                          rope="post"), KVTC(level=2, calibration=cal, **SMALL_LANES))
    ((codec, data, ctxs),) = list(_frames(blob, "cpu"))
    device_ctxs = [replace(c, backend="triton") for c in ctxs]
    wanted = {c.layer for c in ctxs}
    rng = np.random.default_rng(1)
    verdicts = set()
    for pos in rng.integers(8, len(data), 6):  # past the group lengths
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(8))
        outcomes = []
        for c in (ctxs, device_ctxs):
            try:
                outcomes.append(codec.decode_frame(bytes(bad), c, wanted))
            except kvcodec.CorruptDataError:
                outcomes.append(None)
        assert (outcomes[0] is None) == (outcomes[1] is None)
        if outcomes[0] is not None:
            assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-3)
                       for l in wanted for a, b in zip(outcomes[0][l], outcomes[1][l]))
        verdicts.add(outcomes[0] is None)
    assert verdicts == {True, False}  # this seed hits both cases


def test_backend_choice(golden, monkeypatch):
    """``"auto"`` keeps CPU tensors on the CPU path, ``"triton"`` forces the device path, ``"nvdec"`` is refused."""
    kv, cal = golden
    blob = kvcodec.encode(kv, KVTC(calibration=cal, **SMALL_LANES), chunk_tokens=24)

    def refuse(*args, **kwargs):
        raise AssertionError("the device path ran")

    monkeypatch.setattr(gpu, "CoefficientLaunch", refuse)
    kvcodec.decode(blob)
    with pytest.raises(kvcodec.CorruptDataError, match="device path ran"):  # the decoder wraps a codec's failure
        kvcodec.decode(blob, backend="triton")
    with pytest.raises(kvcodec.UnsupportedError, match="nvdec"):
        kvcodec.decode(blob, backend="nvdec")


def test_window_grading_decodes_alike_on_the_device_path(real_kv):
    """A sliding-window layer's graded rows (their coefficients scaled by their age's factor) come out of the
    device path as out of the CPU's (a paged decode runs the same device decode)."""
    from kvcodec.tools.fuzz.seeds import fuzz_kv

    kv = fuzz_kv(real_kv, tokens=72, layers=3, window=40)
    codec = KVTC(level=2, calibration=fuzz_calibration(kv), window_octaves=2, **SMALL_LANES)
    blob = kvcodec.encode(kv, codec, chunk_tokens=24)
    reference, got = kvcodec.decode(blob, backend="cpu"), kvcodec.decode(blob, backend="triton")
    flat = kvcodec.decode(kvcodec.encode(kv, KVTC(level=2, calibration=codec.calibration, window_octaves=0,
                                                  **SMALL_LANES), chunk_tokens=24))
    assert not torch.equal(flat.layers[2].keys, reference.layers[2].keys)  # the window is graded
    for a, b in zip(got.layers, reference.layers):
        for x, y in zip(a, b):
            assert torch.allclose(x.float(), y.float(), rtol=2 ** -7, atol=1e-3)
