"""The golden containers in formats/golden decode to the recorded tensors, and re-encoding is byte-identical."""

from __future__ import annotations

import hashlib
import json
from importlib.resources import files

import pytest

import kvcodec
from kvcodec.cli import parse_codec
from kvcodec.formats.make_golden import decoded_digest

GOLDEN = files("kvcodec.formats") / "golden"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())


@pytest.fixture(autouse=True, scope="module")
def _golden_calibration():
    """The kvtc golden file's calibration, findable by its hash as a decoder would find it."""
    from kvcodec.codecs.kvtc import Calibration, register_calibration

    register_calibration(Calibration.from_bytes((GOLDEN / "kvtc-calibration.kvtc").read_bytes()))


def test_every_golden_file_is_listed():
    on_disk = {p.name for p in GOLDEN.iterdir() if p.name.endswith(".kvc")}
    assert on_disk == set(EXPECTED) and len(on_disk) >= 6


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_decodes_to_recorded_tensors(name):
    blob = (GOLDEN / name).read_bytes()
    exp = EXPECTED[name]
    assert hashlib.sha256(blob).hexdigest() == exp["container_sha256"]
    kv = kvcodec.decode(blob)
    if exp.get("decoded_exact", True):
        assert decoded_digest(kv) == exp["decoded_sha256"]
    else:  # a transform codec's decode is exact only up to the platform's float32 sums: compare with the source
        source = kvcodec.decode((GOLDEN / "raw-f16.kvc").read_bytes())
        assert decoded_digest(source) == exp["source_sha256"]
        for a, b in zip(kv.layers, source.layers):
            for x, y in zip(a, b):
                err = float((x.float() - y.float()).pow(2).mean() / y.float().pow(2).mean())
                assert 0 < err < 0.1
    assert kv.model == "SmolLM2-135M-Instruct" and kv.rope == "post" and len(kv.token_ids) == 40
    if exp["codec"] == "raw":
        assert exp["decoded_sha256"] == exp["source_sha256"]
    else:
        assert exp["decoded_sha256"] != exp["source_sha256"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_reencodes_identically(name):
    """Encoding is deterministic across versions: the same codec and grid reproduce the file from its own
    decode for lossless codecs, and a lossy decode re-quantizes to the same bytes."""
    blob = (GOLDEN / name).read_bytes()
    with kvcodec.open(blob) as r:
        info = r.info
        kv = r.decode()
    if info.codec == "raw":
        again = kvcodec.encode(kv, parse_codec(EXPECTED[name]["codec"]), chunk_tokens=info.chunk_tokens,
                               chunk_layers=info.chunk_layers)
        assert again == blob
    if info.codec == "kvtc":  # the source and the calibration give the same bytes
        source = kvcodec.decode((GOLDEN / "raw-f16.kvc").read_bytes())
        codec = parse_codec(EXPECTED[name]["codec"], [f"calibration={info.config['calibration']}"])
        assert kvcodec.encode(source, codec, chunk_tokens=info.chunk_tokens) == blob
        assert info.version == "1.1"


def test_golden_window_layer_is_right_aligned():
    kv = kvcodec.decode((GOLDEN / "raw-f32-window.kvc").read_bytes())
    assert [l.keys.shape[1] for l in kv.layers] == [40, 40, 40, 24]
    with kvcodec.open((GOLDEN / "raw-f32-window.kvc").read_bytes()) as r:
        first = r.read_chunk(0)  # tokens 0..15: the window layer (last 24 of 40) holds none of them
        assert 3 not in first.layers and r.chunks[0].layer_count == 2
        last = r.read_chunk(r.num_chunks - 1, layers=[3])
        assert last.layers[3].keys.shape[1] == 40 - 32
