"""kvfetcher: KV as lossless HEVC through PyAV, on real SmolLM2 KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcodec.formats.v1 import LayerShape

import kvcodec
from kvcodec.store.telemetry import LINK_PRIOR_BPS, RateEstimator
from kvcodec.tools.adaptation import BandwidthTrace
from kvcodec.chunking import layer_context
from kvcodec.codecs import get_codec
from kvcodec.codecs.base import LayerContext
from kvcodec.codecs.kvfetcher import pictures as P
from kvcodec.tools import kvfetcher_resolution as R
from kvcodec.codecs.kvfetcher import video
from kvcodec.codecs.kvfetcher.codec import KVFetcher
from kvcodec.codecs.kvfetcher.restore import restore_paged
from kvcodec.codecs.kvfetcher.section import HEAD, SectionHead, decode_codes
from kvcodec.codecs.quantize import dequantize
from kvcodec.layouts.paged import slot_mapping

av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def kv3(real_kv):
    """Three real layers (first, middle, last) of the 512-token cache."""
    return kvcodec.KVCache([real_kv.layers[i] for i in (0, 14, 29)])


def _ctx(k: torch.Tensor, dv: int | None = None, dtype=torch.float16, layer: int = 0, model: str | None = None) -> LayerContext:
    h, t, dk = k.shape
    return LayerContext(layer, 30 if model else 1, LayerShape(h, t, dk, dv or dk), dtype, model=model)


@pytest.mark.parametrize("cfg", [dict(bits=4, scale="minmax"), dict(bits=4, delta=True, frame_tokens=96),
                                 dict(bits=10, frame_tokens=512, scale="minmax"), dict(bits=10, frame_tokens=256),
                                 dict(bits=2, frame_tokens=16), dict(bits=4, scale="spread"),
                                 dict(bits=3, scale="spread", key_step=0.5, value_spread=2, delta=True, frame_tokens=64)])
@pytest.mark.parametrize("model", [None, "SmolLM2-135M-Instruct"])
def test_codes_bit_exact_and_half_step(kv3, cfg, model):
    codec = KVFetcher(**cfg)
    k, v = kv3.layers[1]
    k, v = k[:, :200], v[:, :200]  # 200 tokens: a short last block (padding) for every frame height
    ctx = _ctx(k, layer=14, model=model)
    data = codec.encode_layer(k, v, ctx)
    kq, vq, sc = codec.quantize(k, v, ctx)
    dkq, dvq = decode_codes(data, ctx)
    assert np.array_equal(dkq, kq) and np.array_equal(dvq, vq)
    kd, vd = codec.decode_layer(data, ctx)
    assert kd.dtype == torch.float16 and kd.shape == k.shape and vd.shape == v.shape
    # within half a quantization step (plus float16 rounding of the result)
    for x, y, s in ((k, kd, sc.ks), (v, vd, sc.vs)):
        err = (x.float() - y.float()).abs()
        assert bool((err <= s.float() / 2 + x.float().abs() * 2 ** -10 + 1e-3).all())


def test_round_trip_container_and_stream_pieces(kv3):
    blob = kvcodec.encode(kv3, codec="kvfetcher", bits=4, scale="minmax")
    back = kvcodec.decode(blob)
    codec = KVFetcher(bits=4, scale="minmax")
    for (k, v), (kd, vd) in zip(kv3.layers, back.layers):
        for c0 in (0, 256):  # the default 256-token chunks: codes are per section
            kq, vq, sc = codec.quantize(k[:, c0:c0 + 256], v[:, c0:c0 + 256])
            ref_k = dequantize(torch.from_numpy(kq), sc.ks, sc.kz).half()
            ref_v = dequantize(torch.from_numpy(vq), sc.vs, sc.vz).half()
            assert torch.equal(kd[:, c0:c0 + 256], ref_k) and torch.equal(vd[:, c0:c0 + 256], ref_v)
    # the container's stream path, fed in irregular pieces
    data = bytes(blob)
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, len(data)), 40, replace=False))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    streamed = kvcodec.decode(iter(pieces))
    for (a, b), (c, d) in zip(back.layers, streamed.layers):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_video_decoder_in_pieces(kv3):
    codec = KVFetcher(bits=4, frame_tokens=64)
    k, v = kv3.layers[0]
    ctx = _ctx(k)
    data = codec.encode_layer(k, v, ctx)
    stream = data[SectionHead(data, ctx).stream_start:]
    whole = decode_codes(data, ctx)
    for size in (1, 7, 1000):
        pieces = [stream[i:i + size] for i in range(0, len(stream), size)] if size > 1 else \
            [stream[i:i + 1] for i in range(0, min(len(stream), 3000))] + [stream[3000:]]
        got = decode_codes(data, ctx, pieces=pieces)
        assert np.array_equal(got[0], whole[0]) and np.array_equal(got[1], whole[1])


def test_paged_restoration_equals_contiguous(kv3):
    codec = KVFetcher(bits=4, frame_tokens=128)
    kv = kvcodec.KVCache(kv3.layers[:2])
    contiguous = kvcodec.decode(kvcodec.encode(kv, codec=codec, chunk_tokens=256))
    block = 16
    num_blocks = 40
    table = torch.randperm(num_blocks)[: 512 // block].to(torch.int32)  # scattered blocks
    peaks = []
    from kvcodec.chunking import make_header
    header = make_header(kv, [codec], 256)
    for layer in range(kv.num_layers):
        paged, by_slots = (torch.zeros(2, num_blocks, block, 3, 64, dtype=torch.float16) for _ in range(2))
        k, v = kv.layers[layer]
        for c0 in (0, 256):
            ctx = layer_context(header, layer, (c0, c0 + 256), torch.device("cpu"))
            data = codec.encode_layer(k[:, c0:c0 + 256], v[:, c0:c0 + 256], ctx)
            peaks.append(restore_paged(data, ctx, paged, table))
            # the Codec API's paged decode (what engine adapters call) takes the same frame-wise path
            codec.decode_layer_paged(data, ctx, by_slots, slot_mapping(table, c0, 256, block))
        got = kvcodec.KVCache.from_paged([paged], table, 512)
        assert torch.equal(got.layers[0].keys, contiguous.layers[layer].keys)
        assert torch.equal(got.layers[0].values, contiguous.layers[layer].values)
        assert torch.equal(by_slots, paged)
    assert max(peaks) == 4 * 3 * 128 * 64  # one frame of float32 values at a time
    for bad in (torch.arange(255), torch.full((256,), num_blocks * block)):
        with pytest.raises(kvcodec.InvalidInputError):
            codec.decode_layer_paged(data, ctx, paged, bad)


def test_geometry_and_padding():
    g = P.geometry(200, 3, 64, 64, 256)
    assert (g.frame_rows, g.rows, g.cols, g.blocks) == (208, 208, 192, 1)
    g = P.geometry(20, 1, 32, 16, 256)
    assert (g.rows, g.cols) == (video.MIN_SIDE, video.MIN_SIDE)  # never below NVDEC's minimum
    with pytest.raises(kvcodec.InvalidInputError):
        P.geometry(100, 3, 64, 64, 100)
    rng = np.random.default_rng(1)
    for bits in (2, 4, 8, 10):
        q = rng.integers(0, 1 << bits, (3, 37, 5)).astype(np.int32)
        g = P.geometry(37, 3, 5, 5, 48)
        for delta in (False, True):
            f = P.to_frame(q, g, bits, delta)
            assert f.shape == (g.rows, g.cols) and int(f.max()) < (1 << bits)
            if not delta:  # padding rows and columns hold the centre code
                assert (f[37:] == 1 << (bits - 1)).all() and (f[:, 15:] == 1 << (bits - 1)).all()
            assert np.array_equal(P.from_frame(f, 37, 3, 5, bits, delta), q)
            t = P.frame_to_torch(torch.from_numpy(f.astype(np.int32)), 37, 3, 5, bits, delta)
            assert np.array_equal(t.numpy(), q)


def test_config_validation_and_registry():
    assert isinstance(get_codec("kvfetcher", bits=3), KVFetcher)
    for bad in (dict(bits=1), dict(bits=11), dict(frame_tokens=100), dict(preset="x"), dict(delta=1),
                dict(scale="std"), dict(scale=None), dict(scale=["minmax"]), dict(scale="minmax", key_step=1.0),
                dict(scale="minmax", value_spread=0.7), dict(scale="spread", key_step=0),
                dict(scale="spread", value_spread=-1.0), dict(scale="spread", key_step=float("nan")),
                dict(scale="spread", value_spread=float("inf")), dict(scale="spread", key_step=1e6),
                dict(scale="spread", value_spread="1"), dict(scale="spread", key_step=True)):
        with pytest.raises(kvcodec.InvalidInputError):
            KVFetcher(**bad)
    # canonical configs: both steps floats under 'spread' and None under 'minmax'; a config read back is equal
    sp = KVFetcher(scale="spread", key_step=2, value_spread=1)
    assert sp.get_config()["key_step"] == 2.0 and isinstance(sp.get_config()["value_spread"], float)
    assert KVFetcher().get_config() == {"bits": 4, "frame_tokens": 256, "preset": "ultrafast", "delta": False,
                                        "scale": "spread", "key_step": 2.0, "value_spread": 1.0}
    # min-max configs keep their original four keys, so containers written when min-max was the only scale still
    # open: a file's config without `scale` is min-max
    mm = KVFetcher(scale="minmax")
    assert mm.get_config() == {"bits": 4, "frame_tokens": 256, "preset": "ultrafast", "delta": False}
    assert KVFetcher.from_file_config(mm.get_config()).scale == "minmax"
    for c in (sp, KVFetcher(), mm):
        assert KVFetcher.from_file_config(c.get_config()).get_config() == c.get_config()
    assert get_codec("kvfetcher", bits=4).scale == "spread"


def test_spread_scale_round_trip_and_concentration(kv3):
    """scale=spread: codes bit-exact through PyAV and the container (the decoder reads only the stream),
    concentrated near the centre, the section far smaller than min-max's; keys fall back to min-max steps
    (rounded up to the step grid) without a profile, and a profile that does not fit the layer is refused."""
    model = "SmolLM2-135M-Instruct"
    k, v = kv3.layers[1]
    k, v = k[:, :256], v[:, :256]
    ctx = _ctx(k, layer=14, model=model)
    sp, mm = KVFetcher(bits=4, scale="spread"), KVFetcher(bits=4, scale="minmax")
    data = sp.encode_layer(k, v, ctx)
    kq, vq, sc = sp.quantize(k, v, ctx)
    dkq, dvq = decode_codes(data, ctx)
    assert np.array_equal(dkq, kq) and np.array_equal(dvq, vq)
    kd, vd = sp.decode_layer(data, ctx)
    q = torch.from_numpy
    assert torch.equal(kd[:, 1:], (sc.kz.float() + q(kq[:, 1:]).float() * sc.ks).half())
    assert torch.equal(vd[:, 1:], (sc.vm.float() + (q(vq[:, 1:]).float() - 8) * sc.vs[:, 1:]).half())
    # the sequence's first token (the attention sink) is exact and coded as the centre code
    assert torch.equal(kd[:, 0], k[:, 0]) and torch.equal(vd[:, 0], v[:, 0])
    assert (kq[:, 0] == 8).all() and (vq[:, 0] == 8).all() and HEAD.unpack_from(data)[-1] == 1
    later = LayerContext(14, 30, ctx.shape, torch.float16, model=model, token_start=256)
    assert HEAD.unpack_from(sp.encode_layer(k, v, later))[-1] == 0  # only the section holding token 0 has it
    # key steps never below min-max's (over the quantized tokens); codes centred (most within +-2 of 8); nothing
    # clipped beyond float16 rounding
    _, _, msc = mm.quantize(k[:, 1:], v[:, 1:], ctx)
    assert bool((sc.ks >= msc.ks.float()).all())
    assert float((np.abs(kq.astype(int) - 8) <= 2).mean()) > 0.6 and float((np.abs(vq.astype(int) - 8) <= 2).mean()) > 0.6
    for x, y, s in ((k, kd, sc.ks), (v, vd, sc.vs)):
        assert bool(((x.float() - y.float()).abs() <= s * 0.51 + x.float().abs() * 2 ** -10 + 1e-3).all())
    assert len(data) < 0.75 * len(mm.encode_layer(k, v, ctx))
    # no profile for the model: key steps are min-max's, rounded up to the next step of the 2**(1/8) grid
    _, _, sc0 = sp.quantize(k, v, _ctx(k))
    ratio = sc0.ks / msc.ks.float()
    assert bool((ratio >= 1).all()) and bool((ratio < 2 ** 0.125 * 1.01).all())
    with pytest.raises(kvcodec.InvalidInputError):
        sp.quantize(k[:2], v[:2], _ctx(k[:2], layer=14, model=model))
    # through the container (model metadata from the cache) and streamed in pieces
    kv = kvcodec.KVCache(kv3.layers, model=model)
    blob = kvcodec.encode(kv, codec=sp)
    back = kvcodec.decode(blob)
    pieces = [bytes(blob)[i:i + 4099] for i in range(0, len(blob), 4099)]
    for (a, b), (c, d) in zip(back.layers, kvcodec.decode(iter(pieces)).layers):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert len(blob) < 0.85 * len(kvcodec.encode(kv, codec=mm))


def test_key_columns_follow_step_codes(kv3):
    """A spread section's key pictures hold channels in decreasing step-code order (ties by channel), the
    order the decoder derives from the stored codes; value pictures keep channel order."""
    k, v = kv3.layers[2]
    k, v = k[:, :128], v[:, :128]
    ctx = _ctx(k, layer=29, model="SmolLM2-135M-Instruct")
    codec = KVFetcher(bits=4, scale="spread", frame_tokens=128)
    data = codec.encode_layer(k, v, ctx)
    kq, vq, sc = codec.quantize(k, v, ctx)
    head = SectionHead(data, ctx)
    kf, vf = video.decode_stream([bytes(head.stream)], head.geo.rows, head.geo.cols, 4, 2)
    order = head.scales.key_columns
    codes = sc.kc.reshape(-1)
    assert len(set(codes.tolist())) > 4  # a real spread of steps, so the order is not trivial
    assert all(codes[a] > codes[b] or (codes[a] == codes[b] and a < b) for a, b in zip(order, order[1:]))
    assert np.array_equal(kf[:128, :192], kq.transpose(1, 0, 2).reshape(128, 192)[:, order])
    assert np.array_equal(vf[:128, :192], vq.transpose(1, 0, 2).reshape(128, 192))


@pytest.mark.parametrize("scale", ["minmax", "spread"])
def test_corrupt_sections_rejected(kv3, scale):
    codec = KVFetcher(bits=4, frame_tokens=128, scale=scale)
    k, v = kv3.layers[2]
    k, v = k[:, :256], v[:, :256]
    ctx = _ctx(k, layer=29, model="SmolLM2-135M-Instruct")
    data = codec.encode_layer(k, v, ctx)
    stream_at = SectionHead(data, ctx).stream_start
    bad = [data[:10], data[:-1], data + b"\0", b"XXXX" + data[4:],
           data[:4] + bytes([11]) + data[5:],  # bits out of range
           data[:6] + (64).to_bytes(2, "little") + data[8:],  # frame rows that disagree with the picture size
           data[:stream_at] + bytes(len(data) - stream_at),  # stream zeroed
           data[:stream_at + 200] + bytes([data[stream_at + 200] ^ 0x55]) + data[stream_at + 201:],
           data[:len(data) - 3000] + bytes(3000),  # tail damaged (the last ~300 bytes only code padding rows)
           data[:HEAD.size] + b"\x00\x7c" * ((stream_at - HEAD.size) // 2) + data[stream_at:],  # scales +inf
           data[:5] + bytes([data[5] | 4]) + data[6:]]  # an unknown flag
    for i, d in enumerate(bad):
        with pytest.raises(kvcodec.CorruptDataError):
            codec.decode_layer(d, ctx)
    # the wrong shape for the section
    with pytest.raises(kvcodec.CorruptDataError):
        codec.decode_layer(data, _ctx(k[:, :128], layer=29, model="SmolLM2-135M-Instruct"))


def test_resolution_policy_on_traces():
    model = R.FrameModel.linear(R.DEFAULT_LADDER, bytes_per_row=90.0, header_bytes=220.0, decode_fixed_s=1e-4,
                                decode_row_s=9e-6, frames_per_block=60)
    steady = BandwidthTrace.steady(200e6)
    pol = R.ResolutionPolicy(model)
    res = {p.name: R.simulate_fetch(model, steady, 4096, 1024, p) for p in [pol] + [R.FixedHeight(h) for h in R.DEFAULT_LADDER]}
    best_fixed = min(r.restored_s for n, r in res.items() if n.startswith("fixed"))
    assert res["adaptive ladder"].restored_s <= best_fixed * 1.001
    # deterministic
    again = R.simulate_fetch(model, steady, 4096, 1024, R.ResolutionPolicy(model))
    assert again.heights == res["adaptive ladder"].heights and again.restored_s == res["adaptive ladder"].restored_s
    # a jittery trace: still never worse than the worst fixed height, and pipelining beats sequential
    jit = BandwidthTrace.jittery(20e6, 30.0, 0.02, sigma=1.0, seed=3)
    ad = R.simulate_fetch(model, jit, 4096, 1024, R.ResolutionPolicy(model))
    worst = max(R.simulate_fetch(model, jit, 4096, 1024, R.FixedHeight(h)).restored_s for h in R.DEFAULT_LADDER)
    assert ad.restored_s < worst
    seq = R.simulate_fetch(model, jit, 4096, 1024, R.FixedHeight(256), pipelined=False)
    pip = R.simulate_fetch(model, jit, 4096, 1024, R.FixedHeight(256))
    assert pip.restored_s < seq.restored_s and pip.arrived_s == pytest.approx(seq.arrived_s)
    # hand-made situations, two frames (K, V) per token block: on the last GOP, a link about as fast as the
    # decoder -> small frames (a short pipeline tail costs fewer seconds than their extra headers); a fast link
    # with the decoder the bottleneck -> large frames (fewer per-frame costs)
    two = R.FrameModel.linear(R.DEFAULT_LADDER, bytes_per_row=90.0, header_bytes=220.0, decode_fixed_s=1e-4,
                              decode_row_s=9e-6, frames_per_block=2)
    pol2 = R.ResolutionPolicy(two)
    assert pol2.decide(3, 4, 1024, 0.0, 0.0, RateEstimator(50e6)) <= 256
    assert pol2.decide(0, 4, 1024, 0.0, 0.0, RateEstimator(1e10)) == 1024
    # jitter makes the policy plan with a slower link
    est = RateEstimator(LINK_PRIOR_BPS)
    for r in (1e6, 9e6, 1e6):
        est.observe(r, 1.0)
    assert R.ResolutionPolicy.jitter(est) > 0.5


class _FakeNvc:
    """A stand-in for PyNvVideoCodec built on PyAV: NV12 / P016 surfaces (10-bit values in the high bits),
    packets given by address and size, an empty packet for end of stream, after which the session takes a new
    stream (as NVDEC's parser does).  Checks nvdec.py's plumbing on a CPU."""

    class cudaVideoCodec:  # noqa: N801
        HEVC = "hevc"

    class PacketData:
        bsl_data = 0
        bsl = 0

    class _Dec:
        def __init__(self) -> None:
            self.ctx = av.CodecContext.create("hevc", "r")

        def Decode(self, pkt):  # noqa: N802
            import ctypes
            data = ctypes.string_at(pkt.bsl_data, pkt.bsl) if pkt.bsl else None
            packets = list(self.ctx.parse(data)) if data else list(self.ctx.parse(None)) + [None]
            out = []
            ctx = self.ctx
            if data is None:
                self.ctx = av.CodecContext.create("hevc", "r")
            for p in packets:
                for f in ctx.decode(p):
                    if f.format.name == "yuv420p":
                        y = f.to_ndarray(format="nv12")
                        out.append(torch.from_numpy(np.ascontiguousarray(y)))
                    else:
                        y = video.luma(f, f.height, f.width, 10).astype(np.uint16) << 6
                        nv = np.concatenate([y, np.full((f.height // 2, f.width), 512 << 6, np.uint16)])
                        out.append(torch.from_numpy(nv))
            return out

    created = 0

    @staticmethod
    def CreateDecoder(**kwargs):  # noqa: N802
        _FakeNvc.created += 1
        return _FakeNvc._Dec()


@pytest.fixture
def fake_nvdec(monkeypatch):
    from kvcodec.codecs.kvfetcher import nvdec
    monkeypatch.setattr(nvdec, "_nvc", lambda: _FakeNvc)
    monkeypatch.setattr(nvdec, "_IDLE", {})  # kept fake sessions must not outlive the test
    monkeypatch.setattr(_FakeNvc, "created", 0)
    return nvdec


@pytest.mark.parametrize("bits,scale", [(4, "minmax"), (10, "minmax"), (4, "spread")])
def test_nvdec_plumbing_with_a_fake_decoder(kv3, fake_nvdec, bits, scale):
    nvdec = fake_nvdec
    codec = KVFetcher(bits=bits, frame_tokens=128, scale=scale)
    k, v = kv3.layers[1]
    k, v = k[:, :200], v[:, :200]
    ctx = _ctx(k, layer=14, model="SmolLM2-135M-Instruct")
    data = codec.encode_layer(k, v, ctx)
    stream = data[SectionHead(data, ctx).stream_start:]
    ref = decode_codes(data, ctx)
    for reuse in (True, True, False):  # the second decode goes through the session the first one kept
        got = nvdec.decode_codes_nvdec(data, ctx, pieces=[stream[i:i + 999] for i in range(0, len(stream), 999)],
                                       reuse=reuse)
        assert np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1])
    assert _FakeNvc.created == 2


def test_nvdec_restoration_matches_ffmpeg_with_a_fake_decoder(kv3, fake_nvdec):
    """The NVDEC restore path (frame to codes, key column order, dequantization, exact sink token) gives the
    tensors the FFmpeg path gives; the API's 'nvdec' backend refuses a CPU device."""
    nvdec = fake_nvdec
    codec = KVFetcher(frame_tokens=128)
    k, v = kv3.layers[1]
    k, v = k[:, :200], v[:, :200]
    ctx = _ctx(k, layer=14, model="SmolLM2-135M-Instruct")
    data = codec.encode_layer(k, v, ctx)
    ref_k, ref_v = codec.decode_layer(data, ctx)
    got_k, got_v = torch.full_like(ref_k, float("nan")), torch.full_like(ref_v, float("nan"))

    def sink(lo, hi, kk, vv):
        (got_k if kk is not None else got_v)[:, lo:hi] = kk if kk is not None else vv

    nvdec.restore_nvdec(data, ctx, sink)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    blob = kvcodec.encode(kvcodec.KVCache([(k, v)], model="SmolLM2-135M-Instruct"), codec=codec)
    with pytest.raises(kvcodec.InvalidInputError, match="CUDA"):
        kvcodec.decode(blob, backend="nvdec")
    with pytest.raises(kvcodec.UnsupportedError):
        kvcodec.decode(kvcodec.encode(kvcodec.KVCache([(k, v)]), codec="raw"), backend="nvdec")


def test_auto_backend_picks_nvdec_only_for_a_cuda_device_with_pynvvideocodec(monkeypatch):
    from dataclasses import replace

    from kvcodec.codecs.kvfetcher import nvdec
    from kvcodec.codecs.kvfetcher.restore import uses_nvdec
    ctx = replace(_ctx(torch.zeros(1, 4, 8)), backend="auto")
    cuda = replace(ctx, device=torch.device("cuda"))
    for has_nvc in (True, False):
        monkeypatch.setattr(nvdec, "available", lambda: has_nvc)
        assert uses_nvdec(cuda) is has_nvc
        assert not uses_nvdec(ctx)
        assert not uses_nvdec(replace(cuda, backend="cpu"))
        assert uses_nvdec(replace(ctx, backend="nvdec"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(layer=st.integers(0, 29), start=st.integers(0, 511), tokens=st.integers(1, 300),
       bits=st.integers(2, 10), rows=st.sampled_from([16, 48, 128, 256]), scale=st.sampled_from(["spread", "minmax"]),
       delta=st.booleans(), token_start=st.sampled_from([0, 1, 256]), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_round_trip_property_on_real_slices(real_kv, layer, start, tokens, bits, rows, scale, delta, token_start, dtype):
    """Any real slice, bit depth, frame height, scale, delta and position: the codes come back bit-exactly through
    PyAV, every value within half a step (exact for the sink token), and the contiguous and paged decodes agree."""
    k, v = real_kv.layers[layer]
    k, v = k[:, start:start + tokens].to(dtype), v[:, start:start + tokens].to(dtype)
    t = k.shape[1]
    codec = KVFetcher(bits=bits, frame_tokens=rows, scale=scale, delta=delta)
    ctx = LayerContext(layer, 30, LayerShape(3, t, 64, 64), dtype, model="SmolLM2-135M-Instruct", token_start=token_start)
    data = codec.encode_layer(k, v, ctx)
    kq, vq, sc = codec.quantize(k, v, ctx)
    dkq, dvq = decode_codes(data, ctx)
    assert np.array_equal(dkq, kq) and np.array_equal(dvq, vq)
    kd, vd = codec.decode_layer(data, ctx)
    exact = HEAD.unpack_from(data)[-1]
    assert exact == (1 if scale == "spread" and token_start == 0 and t > 1 else 0)
    for x, y, s in ((k, kd, sc.ks), (v, vd, sc.vs)):
        err = (x.float() - y.float()).abs()
        s = s[:, exact:] if s.shape[1] == t else s  # per-token value steps, per-channel key steps
        assert bool((err[:, exact:] <= s.float() / 2 * 1.01 + x.float()[:, exact:].abs() * 2 ** -7 + 1e-3).all())
        assert torch.equal(y[:, :exact], x[:, :exact])
    paged = torch.zeros(2, -(-t // 16) + 2, 16, 3, 64, dtype=dtype)
    slots = torch.randperm(paged.shape[1] * 16)[:t]
    codec.decode_layer_paged(data, ctx, paged, slots)
    flat = paged.view(2, -1, 3, 64)
    assert torch.equal(flat[0, slots].transpose(0, 1), kd) and torch.equal(flat[1, slots].transpose(0, 1), vd)


def test_layers_in_parallel_make_the_same_bytes(kv3):
    """encode_layers / decode_layers run a chunk's sections on threads; the result is the sequential one."""
    codec = KVFetcher(frame_tokens=64)
    pairs = [(k[:, :128], v[:, :128]) for k, v in kv3.layers]
    ctxs = [_ctx(k, layer=i, model="SmolLM2-135M-Instruct") for i, (k, _) in zip((0, 14, 29), pairs)]
    sections = codec.encode_layers(pairs, ctxs)
    assert sections == [codec.encode_layer(k, v, c) for (k, v), c in zip(pairs, ctxs)]
    for (a, b), data, c in zip(codec.decode_layers(sections, ctxs), sections, ctxs):
        ra, rb = codec.decode_layer(data, c)
        assert torch.equal(a, ra) and torch.equal(b, rb)
