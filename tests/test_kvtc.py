"""kvtc: calibration files, joint sections (format 1.1), round trips, selection, errors, positions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.chunking import layer_context
from kvcodec.codecs.kvtc import KVTC, Calibration, MissingCalibrationError
from kvcodec.codecs.kvtc import calibration as calmod
from kvcodec.codecs.kvtc.calibration import LayerInfo
from kvcodec.codecs.kvtc.fit import default_groups, fit_calibration
from kvcodec.positions import Rotary, reposition
from kvcodec.container import Frame, write_container
from kvcodec.errors import CorruptDataError, InvalidInputError

L, H, D, RANK = 4, 2, 8, 5
ROT = Rotary(10000.0 ** (-np.arange(0, D, 2, dtype=np.float64) / D))


def _pre_rope(tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Low-rank pre-RoPE keys and values shared across layers (synthetic: for round-trip properties only)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(RANK, L * H * D * 2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(tokens, RANK, generator=g) @ mix + 0.01 * torch.randn(tokens, L * H * D * 2, generator=g)
    x = x.reshape(tokens, 2, L, H, D)
    return [(x[:, 0, l].permute(1, 0, 2).contiguous(), x[:, 1, l].permute(1, 0, 2).contiguous()) for l in range(L)]


def _cache(tokens: int, seed: int, dtype: torch.dtype = torch.float32) -> kvcodec.KVCache:
    pos = torch.arange(tokens)
    layers = [(ROT.rotate(k, pos), v) for k, v in _pre_rope(tokens, seed)]
    return kvcodec.KVCache(layers, model="toy", rope="post").to(dtype=dtype)


@pytest.fixture(scope="module")
def toy_cal() -> Calibration:
    layers = [LayerInfo(H, D, D, ROT) for _ in range(L)]
    groups = default_groups(layers, 2)
    data = _pre_rope(2000, 1)
    flat = [(k.permute(1, 0, 2).reshape(2000, -1), v.permute(1, 0, 2).reshape(2000, -1)) for k, v in data]
    ones = [torch.ones(H * D) for _ in range(L)]
    cal = fit_calibration("toy", layers, groups, [k for k, _ in flat], [v for _, v in flat], ones, ones, (0.01, 0.01))
    kvcodec.codecs.kvtc.register_calibration(cal)
    return cal


def test_calibration_file_round_trip_and_hash(tmp_path, toy_cal):
    path = tmp_path / "c.kvtc"
    digest = toy_cal.save(path)
    assert digest == toy_cal.digest
    back = Calibration.load(path, digest)
    assert back.digest == digest and back.groups == [[0, 1], [2, 3]]
    assert torch.equal(back.keys[1].basis, toy_cal.keys[1].basis)
    assert np.array_equal(back.layers[0].rotary.inv_freq, ROT.inv_freq)
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    with pytest.raises(CorruptDataError, match="does not match its hash"):
        Calibration.from_bytes(bytes(data), digest)
    with pytest.raises(CorruptDataError):
        Calibration.from_bytes(b"not a calibration at all")


def test_round_trip_error_sinks_and_determinism(toy_cal):
    kv = _cache(300, 2)
    codec = KVTC(level=4, calibration=toy_cal)
    blob = kvcodec.encode(kv, codec, chunk_tokens=128)
    assert blob == kvcodec.encode(kv, codec, chunk_tokens=128)
    with kvcodec.open(blob) as r:
        assert r.info.version == "1.1"
        assert r.header.variants[0].joint and r.info.config["calibration"] == toy_cal.digest
    out = kvcodec.decode(blob)
    assert out.shapes == kv.shapes
    key_step, value_step = kvcodec.codecs.kvtc.levels.LEVELS[4]
    for a, b in zip(kv.layers, out.layers):
        assert torch.equal(b.keys[:, :1], a.keys[:, :1].half().float())  # the sink token is exact (float16)
        # orthonormal basis and unit weights: an element's error is at most half a step per live component
        assert float((a.keys - b.keys).abs().max()) < 0.5 * key_step * math.sqrt(RANK) + 0.1
        assert float((a.values - b.values).abs().max()) < 0.5 * value_step * math.sqrt(RANK) + 0.1
    assert 8 * len(blob) / kv.num_elements < 4  # a rank-5 cache codes to far less than float16


def test_layers_selection_and_read_chunk(toy_cal):
    kv = _cache(200, 3, torch.float16)
    blob = kvcodec.encode(kv, KVTC(calibration=toy_cal), chunk_tokens=64)
    full = kvcodec.decode(blob)
    part = kvcodec.decode(blob, layers=[2])
    assert torch.equal(part.layers[0].keys, full.layers[2].keys)
    with kvcodec.open(blob) as r:
        chunk = r.read_chunk(1, layers=[3, 0])
        assert sorted(chunk.layers) == [0, 3]
        assert torch.equal(chunk.layers[3].values, full.layers[3].values[:, 64:128])
        with pytest.raises(InvalidInputError):
            r.read_chunk(0, layers=[7])
    # streamed decode gives the same cache
    assert kvcodec.decode(iter([blob[:1000], blob[1000:]])).equal(full)


def test_missing_calibration_names_its_hash(toy_cal, tmp_path, monkeypatch):
    blob = kvcodec.encode(_cache(40, 4), KVTC(calibration=toy_cal))
    monkeypatch.setattr(calmod, "_registered", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(calmod.ENV_PATH, raising=False)
    with pytest.raises(MissingCalibrationError, match=toy_cal.digest):
        kvcodec.decode(blob)
    folder = tmp_path / "cals"
    calmod.install(toy_cal, str(folder))
    monkeypatch.setenv(calmod.ENV_PATH, str(folder))
    assert kvcodec.decode(blob).num_layers == L
    assert calmod.calibration_for_model("toy").digest == toy_cal.digest


def test_joint_frames_are_checked(toy_cal):
    kv = _cache(10, 5)
    blob = kvcodec.encode(kv, KVTC(calibration=toy_cal))
    with kvcodec.open(blob) as r:
        header, section = r.header, r._container.read_frame(0).sections[0]
    # data in a section other than the first is corrupt
    bad = b"".join(write_container(header, [Frame(0, 0, 10, 0, [section, b"x", b"", b""])]))
    with pytest.raises(CorruptDataError, match="joint"):
        kvcodec.decode(iter([bad]))
    with kvcodec.open(bad) as r, pytest.raises(CorruptDataError, match="joint"):
        r.verify()
    # a truncated group is corrupt
    bad = b"".join(write_container(header, [Frame(0, 0, 10, 0, [section[:-3], b"", b"", b""])]))
    with pytest.raises(CorruptDataError):
        kvcodec.decode(bad)
    # the variant's joint flag must match the codec
    raw = kvcodec.encode(kv, "raw").replace(b'"codec":"raw"', b'"codec":"raw","joint":true')
    with pytest.raises(CorruptDataError):
        kvcodec.decode(raw)


def test_codec_needs_whole_groups_and_a_calibration(toy_cal):
    with pytest.raises(InvalidInputError, match="calibration"):
        kvcodec.encode(kvcodec.KVCache(_cache(10, 6).layers, model="unknown-model"), "kvtc")
    with pytest.raises(InvalidInputError, match="together"):
        kvcodec.encode(_cache(10, 6), KVTC(calibration=toy_cal), chunk_layers=3)


def _kv_at(model, ids: list[int], start: int, name: str) -> kvcodec.KVCache:
    """The model's own float32 KV of ``ids`` computed at positions ``start..start+len(ids)``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache, position_ids=torch.arange(start, start + len(ids))[None])
    return kvcodec.KVCache.from_hf(cache, model=name, rope="post")


def test_reposition_raw_float32_matches_model_at_shifted_positions(smollm2):
    """The KV of a text at positions 0..T moved to P..P+T equals the model's own KV computed at P..P+T."""
    from kvcodec.codecs.kvtc.fit import model_layers

    model = smollm2.model
    ids = smollm2.tokenize("The quick brown fox jumps over the lazy dog. " * 6)[:48]
    rot = [l.rotary for l in model_layers(model)]
    base, shifted = _kv_at(model, ids, 0, "m"), _kv_at(model, ids, 700, "m")
    moved = reposition(kvcodec.decode(kvcodec.encode(base, "raw")), range(700, 700 + len(ids)), rotary=rot)
    assert moved.positions == list(range(700, 748))
    for a, b in zip(moved.layers, shifted.layers):
        assert torch.allclose(a.keys, b.keys, atol=2e-4, rtol=1e-4)
        assert torch.allclose(a.values, b.values, atol=2e-4, rtol=1e-4)  # deeper layers: float noise of the run
    far = max(float((a.keys - b.keys).abs().max()) for a, b in zip(base.layers, shifted.layers))
    assert far > 0.1  # the shift really changes the keys


def test_read_chunk_moves_keys_to_new_positions(smollm2):
    """read_chunk(i, positions=) gives the model's own KV of that chunk's tokens computed at the new positions:
    float32-close from a raw container (rotary setting from the model's installed calibration), within the
    codec's error from a kvtc container (its own calibration), and nothing installed is an error."""
    from kvcodec.codecs.kvtc.fit import model_layers

    model = smollm2.model
    ids = smollm2.tokenize("The quick brown fox jumps over the lazy dog. " * 6)[:48]
    name = "smollm2-read-chunk-test"  # a model name of its own: other tests' calibrations do not answer for it
    base, shifted = _kv_at(model, ids, 0, name), _kv_at(model, ids, 500, name)
    raw = kvcodec.encode(base, "raw", chunk_tokens=16)
    with kvcodec.open(raw) as r, pytest.raises(InvalidInputError, match="no rotary setting"):
        r.read_chunk(1, positions=range(516, 532))
    # a small calibration of SmolLM2 fitted on these very tokens: enough for the rotary setting and a kvtc round trip
    layers = model_layers(model)
    flat = [(layer.rotary.rotate(l.keys, torch.arange(48), inverse=True), l.values) for layer, l in zip(layers, base.layers)]
    feats = [(k.permute(1, 0, 2).reshape(48, -1), v.permute(1, 0, 2).reshape(48, -1)) for k, v in flat]
    ones = [torch.ones(l.heads * l.key_dim) for l in layers]
    cal = fit_calibration(name, layers, default_groups(layers, 5), [k for k, _ in feats], [v for _, v in feats],
                          ones, ones, (1e-3, 1e-3))
    kvcodec.codecs.kvtc.register_calibration(cal)
    with kvcodec.open(raw) as r:
        with pytest.raises(InvalidInputError, match="positions"):
            r.read_chunk(1, positions=range(5))
        chunk = r.read_chunk(1, positions=range(516, 532), layers=[0, 29])
        assert sorted(chunk.layers) == [0, 29]
        for l in (0, 29):
            assert torch.allclose(chunk.layers[l].keys, shifted.layers[l].keys[:, 16:32], atol=2e-4, rtol=1e-4)
            assert torch.allclose(chunk.layers[l].values, shifted.layers[l].values[:, 16:32], atol=2e-4, rtol=1e-4)
        assert float((r.read_chunk(1).layers[29].keys - shifted.layers[29].keys[:, 16:32]).abs().max()) > 0.1
    blob = kvcodec.encode(base, KVTC(level=1, calibration=cal), chunk_tokens=16)
    codec_error = max(float((a.keys - b.keys).abs().max()) for a, b in zip(kvcodec.decode(blob).layers, base.layers))
    with kvcodec.open(blob) as r:
        chunk = r.read_chunk(2, positions=range(532, 548))
        for l, layer in chunk.layers.items():
            error = float((layer.keys - shifted.layers[l].keys[:, 32:48]).abs().max())
            assert error < 2 * codec_error + 1e-3, (l, error, codec_error)


def test_store_keeps_the_calibration_beside_the_chunks(toy_cal, tmp_path, monkeypatch):
    """A store on another machine (no calibration installed) decodes kvtc chunks from a shared tier."""
    from kvcodec.store import KVStore
    from kvcodec.store.tiers import DiskTier

    kv = _cache(96, 7)
    ids = list(range(96))
    writer = KVStore([DiskTier(tmp_path / "shared")], model="toy", codec=KVTC(calibration=toy_cal), chunk_tokens=32)
    assert writer.put(ids, kvcodec.KVCache(kv.layers, model="toy", rope="post")) == 3
    monkeypatch.setattr(calmod, "_registered", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    reader = KVStore([DiskTier(tmp_path / "shared")], model="toy", codec=KVTC(calibration=toy_cal.digest), chunk_tokens=32)
    got = reader.get(ids)
    assert got is not None and got.num_tokens == 96 and reader.stats["corrupt"] == 0
    # kvtc chunks record their absolute positions (it undoes the rotary embedding at them): the stored cache is
    # what encoding the whole cache gives, chunk for chunk (but for each chunk's first token, kept exact there;
    # and without fine rows, which a chunk picks among the rows it codes, so that token changes them)
    with kvcodec.open(reader.fetch(ids)[2].data) as r:
        assert r.header.meta["positions"] == list(range(64, 96))
    plain = KVTC(calibration=toy_cal, fine_tokens=0)
    stored = KVStore([DiskTier(tmp_path / "plain")], model="toy", codec=plain, chunk_tokens=32)
    stored.put(ids, kvcodec.KVCache(kv.layers, model="toy", rope="post"))
    got = stored.get(ids)
    whole = kvcodec.decode(kvcodec.encode(kv, plain, chunk_tokens=32))
    coded = [t for t in range(96) if t % 32]
    assert all(torch.equal(a.keys[:, coded], b.keys[:, coded]) for a, b in zip(got.layers, whole.layers))


def test_min_std_leaves_small_components_uncoded(toy_cal):
    """min_std=0 codes every component and is what a config without min_std means; a larger min_std codes a
    leading subset (the basis is sorted by variance), and the file still round-trips."""
    every = KVTC(calibration=toy_cal, min_std=0)
    assert every.coded_components() == [(k.components, v.components) for k, v in zip(toy_cal.keys, toy_cal.values)]
    assert "min_std" not in every.get_config() and KVTC.from_file_config(every.get_config()).min_std == 0
    fewer = KVTC(calibration=toy_cal, min_std=1.0)
    assert all(a <= b for pair, full in zip(fewer.coded_components(), every.coded_components())
               for a, b in zip(pair, full))
    assert fewer.coded_components() != every.coded_components()
    kv = _cache(40, 4)
    assert kvcodec.decode(kvcodec.encode(kv, fewer)).layers[0].keys.shape == kv.layers[0].keys.shape


def test_fine_tokens_are_the_smallest_keys_at_finer_steps(toy_cal):
    """With fine_tokens, each chunk's rows whose key is smallest against the chunk's usual one in some layer and
    head (attention sinks) are coded at steps fine_octaves finer, on the normal part's live components with its
    tables that many octaves wider; a config without the option means none."""
    from kvcodec.codecs.entropy.tables import STEPS

    plain = KVTC(level=2, calibration=toy_cal, fine_tokens=0)
    assert "fine_tokens" not in plain.get_config()
    assert KVTC.from_file_config(plain.get_config()).fine_tokens == 0
    codec = KVTC(level=2, calibration=toy_cal, fine_tokens=2, fine_octaves=2)
    assert KVTC.from_file_config(codec.get_config()).get_config() == codec.get_config()
    pre = _pre_rope(200, 9)
    for token, layer in ((37, 1), (150, 2)):  # one head's key shrunk in one layer: a sink's mark
        pre[layer][0][0, token] *= 0.02
    pos = torch.arange(200)
    kv = kvcodec.KVCache([(ROT.rotate(k, pos), v) for k, v in pre], model="toy", rope="post")
    blob = kvcodec.encode(kv, codec, chunk_tokens=256)
    with kvcodec.open(blob) as r:
        assert r.info.config["fine_tokens"] == 2
        frame = r._container.read_frame(0)
        ctxs = [layer_context(r.header, l, r.header.local_range(l, 0, 200), torch.device("cpu"), "cpu")
                for l in sorted(frame.sections)]
    for g, present, block in codec.group_blocks(frame.sections[0], ctxs, {c.layer for c in ctxs}):
        parts, _, fine = codec.parse_group(g, present, block)
        keys, values, _ = codec._features(g, [((kv.layers[c.layer].keys, kv.layers[c.layer].values), c)
                                              for c in present])
        assert fine.tolist() == codec.fine_rows(keys, values, (D, D))[0].tolist()
        assert (36 if g == 0 else 149) in fine  # the group's own shrunk key (row = token - 1 sink token)
        for side, (x, gb) in enumerate(zip((keys, values), (toy_cal.keys[g], toy_cal.values[g]))):
            normal, finer = parts[side], parts[2 + side]
            assert np.array_equal(finer.live, normal.live)
            assert np.array_equal(finer.table[finer.live], np.minimum(normal.table[normal.live] + 8, 47))
            exact = codec._project((x[fine] - gb.mean) * gb.weight, gb, 0, finer.span)
            got = codec.coefficients(finer).double().numpy().T
            step = STEPS[finer.codes[:finer.span]].astype(np.float64)
            live = finer.live
            assert np.all(np.abs(got[live] - exact[live]) <= step[live, None] / 2 * (1 + 1e-6))
            assert np.all(finer.codes[live] <= normal.codes[live] - 16)  # a quarter of the step, or finer
    # every other token decodes as without fine tokens, but for a rare coefficient within the float32
    # projection's rounding of a half step (the product may round with the row count): the rows go back in place
    out, without = kvcodec.decode(blob), kvcodec.decode(kvcodec.encode(kv, plain, chunk_tokens=256))
    others = [t for t in range(200) if t not in (37, 150)]
    for a, b in zip(out.layers, without.layers):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            moved = ((x[:, others] - y[:, others]).abs().amax((0, 2)) > 1e-4).sum()
            assert moved <= 2
        assert not torch.equal(a.values[:, [37, 150]], b.values[:, [37, 150]])


def test_fine_rows_are_checked(toy_cal):
    codec = KVTC(level=2, calibration=toy_cal, fine_tokens=2)
    kv = _cache(40, 10)
    blob = kvcodec.encode(kv, codec)
    with kvcodec.open(blob) as r:
        header, section = r.header, r._container.read_frame(0).sections[0]
    # the first group's block starts after the two group lengths: its fine row count, then its rows
    for at, value, why in ((8, b"\x03\x00", "count over fine_tokens"), (10, b"\x05\x00\x05\x00", "rows not increasing"),
                           (12, b"\x27\x00", "a row past the chunk's 39")):
        bad = bytearray(section)
        bad[at:at + len(value)] = value
        frame = b"".join(write_container(header, [Frame(0, 0, 40, 0, [bytes(bad), b"", b"", b""])]))
        with pytest.raises(CorruptDataError, match="fine rows"):
            kvcodec.decode(frame)
    for bad in ({"fine_tokens": -1}, {"fine_tokens": 1025}, {"fine_octaves": 0}, {"fine_octaves": 5},
                {"fine_tokens": True}):
        with pytest.raises(InvalidInputError, match="fine_"):
            KVTC(calibration=toy_cal, **bad)


def test_window_grading_coarsens_a_windows_oldest_tokens(real_kv):
    """A sliding-window layer's rows get steps ``2 ** (window_octaves * age / W)`` times the level's: on real KV its
    oldest rows come back with the larger error, the layers that hold every token are coded exactly as without
    grading, and a config without the option (files written before it) means none."""
    from kvcodec.tools.fuzz.seeds import fuzz_calibration, fuzz_kv

    kv = fuzz_kv(real_kv, tokens=160, layers=3, window=128)
    cal = fuzz_calibration(kv)
    flat, graded = (KVTC(level=2, calibration=cal, fine_tokens=0, window_octaves=o) for o in (0, 2))
    assert "window_octaves" not in flat.get_config() and graded.get_config()["window_octaves"] == 2.0
    assert KVTC.from_file_config({k: v for k, v in graded.get_config().items() if k != "window_octaves"}
                                 ).window_octaves == 0
    header = _header(kvcodec.encode(kv, graded, chunk_tokens=64))
    ctx = layer_context(header, 2, (64, 128), torch.device("cpu"))
    assert ctx.window_tokens == 128
    assert torch.equal(graded.row_gains(ctx), torch.exp2(2 * (127 - torch.arange(64, 128, dtype=torch.float64)) / 128
                                                          ).float())
    assert graded.row_gains(layer_context(header, 0, (0, 64), torch.device("cpu"))) is None
    errors = {}
    for codec in (flat, graded):
        out = kvcodec.decode(kvcodec.encode(kv, codec, chunk_tokens=64))
        errors[codec.window_octaves] = out
        # keys: their error is the steps' (level 2 leaves most value components of this small cache at 0)
        window = (out.layers[2].keys.float() - kv.layers[2].keys.float()).pow(2).mean((0, 2))
        oldest, newest = float(window[1:33].mean()), float(window[-32:].mean())
        if codec.window_octaves:
            assert oldest > 4 * newest  # steps about 2.8x apart (measured: 6.9x the squared error)
        else:
            assert 0.5 < oldest / newest < 2
    for a, b in zip(errors[0.0].layers[:2], errors[2.0].layers[:2]):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _header(blob: bytes):
    with kvcodec.open(blob) as r:
        return r.header
