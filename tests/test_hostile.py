"""Hostile containers: files made on purpose, every checksum valid (issue 14).

The reproducers of the issue, the caller's ``max_bytes`` limit, the re-sealing helper the fuzzer rests on, and
a short deterministic fuzz run of every codec through all three read paths (bench/fuzz_containers.py runs the
long one).
"""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import CorruptDataError, InvalidInputError, LimitExceededError
from kvcodec.codecs.kvfetcher import sps, video
from kvcodec.formats import v1
from kvcodec.tools.fuzz.container import FrameParts, seal, unseal
from kvcodec.tools.fuzz.runner import HEADER_FACTOR, Worker, fuzz, header_length, memory_bound
from kvcodec.tools.fuzz.seeds import fuzz_kv, hevc_donors, make_seeds
from kvcodec.tools.fuzz.worker import pieces


@pytest.fixture(scope="module")
def small_kv(real_kv):
    return fuzz_kv(real_kv)


@pytest.fixture(scope="module")
def seeds(small_kv):
    return make_seeds(small_kv)


def every_path(data: bytes, **options) -> list[Exception]:
    """The exception each of the three read paths raises on ``data`` (None where it decodes)."""
    def whole():
        kvcodec.decode(data, **options)

    def by_chunk():
        with kvcodec.open(data, **options) as r:
            for i in range(r.num_chunks):
                r.read_chunk(i)

    def streamed():
        kvcodec.decode(pieces(data, 1), **options)

    out = []
    for fn in (whole, by_chunk, streamed):
        try:
            fn()
            out.append(None)
        except Exception as e:  # noqa: BLE001 - the test looks at what escapes
            out.append(e)
    return out


def edit_header(parts, **changes) -> None:
    obj = json.loads(parts.header)
    obj.update(changes)
    parts.header = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def with_header(data: bytes, **changes) -> bytes:
    parts = unseal(data)
    edit_header(parts, **changes)
    return seal(parts)


def raw_container(tokens: int = 3) -> bytes:
    kv = kvcodec.KVCache([(torch.ones(1, tokens, 2, dtype=torch.float16), torch.ones(1, tokens, 2, dtype=torch.float16))])
    return kvcodec.encode(kv, "raw", chunk_tokens=2)


# ----------------------------------------------------------------------------------------- re-sealing


def test_sealing_unmutated_seeds_gives_their_bytes(seeds):
    assert {s.name for s in seeds} >= {"raw", "kivi", "fp8", "zstd", "cachegen", "lmcache-cachegen", "kvfetcher",
                                       "multi-level", "kvtc"}
    for s in seeds:
        assert seal(unseal(s.data)) == s.data, s.name


def test_sealed_mutations_pass_every_checksum(seeds):
    """A mutated section re-sealed reaches the codec: the error is the codec's, not a checksum mismatch."""
    parts = unseal(next(s for s in seeds if s.name == "kivi").data)
    f = parts.frames[0]
    f.sections[0] = f.sections[0][:-1]
    errors = every_path(seal(parts))
    assert all(isinstance(e, CorruptDataError) and "kivi" in str(e) and "checksum" not in str(e) for e in errors), errors
    lied = unseal(raw_container())
    lied.frames[0] = FrameParts(**{**lied.frames[0].__dict__, "lengths": {0: 5}})
    errors = every_path(seal(lied))  # the stream reads the 5 bytes the table says: a section checksum fails there
    assert all(isinstance(e, CorruptDataError) for e in errors), errors


# ----------------------------------------------------------------------------------------- the reproducers


@pytest.mark.parametrize("depth", [v1.MAX_JSON_DEPTH - 2, v1.MAX_JSON_DEPTH - 1, 3000, 200_000])
def test_deep_json_nesting_is_corrupt_data(depth):
    """meta nested thousands of levels deep leaked RecursionError; now any header deeper than MAX_JSON_DEPTH
    (the top object and meta are two levels) is corrupt data, and one at the limit reads."""
    parts = unseal(raw_container())
    obj = json.loads(parts.header)
    text = json.dumps({k: v for k, v in obj.items() if k != "meta"}, sort_keys=True, separators=(",", ":"))
    parts.header = (text[:-1] + ',"meta":{"deep":' + "[" * depth + "]" * depth + "}}").encode()
    errors = every_path(seal(parts))
    if depth + 2 <= v1.MAX_JSON_DEPTH:
        assert errors == [None, None, None]
    else:
        assert all(isinstance(e, CorruptDataError) and "nests deeper" in str(e) for e in errors), errors


@pytest.mark.parametrize("layers,tokens", [(1, 1 << 24), (64, 1 << 26), (4096, 1 << 26)])
def test_huge_slot_counts_are_checked_before_any_list(layers, tokens):
    """One layer of 2**24 tokens in chunks of 1 token (within the limits) took minutes and hundreds of MB to
    reach the first check; 64 layers of 2**26 tokens raised MemoryError.  Now the slot count is arithmetic, the
    cursor computes each slot when a frame arrives, and the tiny file is rejected at once."""
    data = with_header(raw_container(), layers=[[1, tokens, 1, 1]] * layers, chunk_tokens=1)
    assert len(data) < 600_000
    tracemalloc.start()
    try:
        errors = every_path(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(isinstance(e, CorruptDataError) for e in errors), errors
    assert peak < HEADER_FACTOR * len(data) + (1 << 20)  # the header's own JSON objects, no slot list
    if layers * tokens > v1.MAX_CHUNKS:
        assert all("exceed" in str(e) for e in errors)


def test_slots_are_computed_one_at_a_time():
    h = v1.Header("float16", (v1.LayerShape(1, 1 << 24, 1, 1),) * 3, (v1.Variant("raw", {}),), 1, 2)
    assert h.num_cells == 2 << 24
    assert h.cell(0) == (0, 1, 0, 2) and h.cell(1) == (0, 1, 2, 1) and h.cell(h.num_cells - 1) == ((1 << 24) - 1, 1, 2, 1)
    small = v1.Header("float16", (v1.LayerShape(1, 5, 1, 1),) * 3, (v1.Variant("raw", {}),), 2, 2)
    assert list(small.cells()) == [(t, min(2, 5 - t), l, 2 if l == 0 else 1) for t in (0, 2, 4) for l in (0, 2)]


def test_kvfetcher_checks_its_section_before_allocating(seeds, monkeypatch):
    """A header declaring a [4096, 300, 4096] float32 layer asked for 2 x 8 GiB before the kvfetcher section
    was looked at; now the section head is checked first and nothing that size is requested."""
    seed = next(s for s in seeds if s.name == "kvfetcher")
    parts = unseal(seed.data)
    edit_header(parts, dtype="float32", layers=[[4096, 300, 4096, 4096]] * 3, chunk_tokens=300, chunk_layers=3)
    parts.frames = [FrameParts(0, 0, 300, 0, [s for f in parts.frames[:2] for s in f.sections][:3])]
    asked = []
    real_empty = torch.empty

    def empty(*size, **kw):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        asked.append(int(np.prod(shape)))
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    errors = every_path(seal(parts))
    assert all(isinstance(e, CorruptDataError) and "kvfetcher" in str(e) for e in errors), errors
    assert max(asked, default=0) < 1 << 24


def _rewrite_sps_size(stream: bytes, width: int, height: int) -> bytes:
    """``stream`` with the picture size in its SPS replaced (the exp-Golomb fields re-written bit by bit)."""
    start = stream.index(b"\x00\x00\x01\x42") + 3  # NAL type 33 (SPS), layer 0
    end = stream.find(b"\x00\x00\x01", start)
    end = len(stream) if end < 0 else end
    rbsp = sps._rbsp(stream[start + 2:end])
    bits = "".join(f"{b:08b}" for b in rbsp)
    r = sps._Bits(rbsp)
    r.u(4), r.u(3), r.u(1), r.u(96)  # no sub-layers in kvfetcher's streams
    r.ue(), r.ue()
    before = r.pos
    w, h = r.ue(), r.ue()
    assert (w, h) == (192, 144)

    def ue(v: int) -> str:
        code = f"{v + 1:b}"
        return "0" * (len(code) - 1) + code

    rest = bits[r.pos:].rstrip("0")  # ends with the RBSP stop bit
    new = bits[:before] + ue(width) + ue(height) + rest
    new += "0" * (-len(new) % 8)
    payload = bytes(int(new[i:i + 8], 2) for i in range(0, len(new), 8))
    escaped = bytearray()
    zeros = 0
    for b in payload:  # emulation prevention (H.265 §7.4.2)
        if zeros >= 2 and b <= 3:
            escaped.append(3)
            zeros = 0
        escaped.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return stream[:start + 2] + bytes(escaped) + stream[end:]


def test_sps_parser_reads_x265_streams():
    for bits, (rows, cols) in ((4, (144, 192)), (10, (160, 256)), (8, (400, 400))):
        stream = video.encode_frames([np.full((rows, cols), 1, np.uint16)], bits)
        sps.check_parameter_sets(stream, rows, cols, bits)
        with pytest.raises(CorruptDataError, match="declares"):
            sps.check_parameter_sets(stream, rows + 16, cols, bits)
        with pytest.raises(CorruptDataError, match="declares"):
            sps.check_parameter_sets(stream, rows, cols, 10 if bits <= 8 else 8)


def test_hevc_picture_larger_than_the_section_is_refused_before_decoding(seeds, monkeypatch):
    """An HEVC stream declaring an 8192x4352 picture inside a 144x192 kvfetcher section: FFmpeg decoded the
    picture (135 MB) before the size check; now its SPS is refused before any packet reaches the decoder."""
    seed = next(s for s in seeds if s.name == "kvfetcher")
    parts = unseal(seed.data)
    section = parts.frames[0].sections[0]
    (stream_len,) = struct.unpack_from("<I", section, 14)
    stream = section[len(section) - stream_len:]
    big = _rewrite_sps_size(stream, 8192, 4352)
    assert sps.sps_picture(sps._rbsp(big[big.index(b"\x00\x00\x01\x42") + 5:]))[:2] == (8192, 4352)
    head = bytearray(section[:len(section) - stream_len])
    head[14:18] = struct.pack("<I", len(big))
    parts.frames[0].sections[0] = bytes(head) + big
    decoded = []
    import av
    real_decode = av.CodecContext.decode

    def counting_decode(self, packet=None):
        out = real_decode(self, packet)
        decoded.extend(out)
        return out

    monkeypatch.setattr(av.CodecContext, "decode", counting_decode, raising=False)
    errors = every_path(seal(parts))
    assert all(isinstance(e, CorruptDataError) and "8192x4352" in str(e) for e in errors), errors
    assert {(f.width, f.height) for f in decoded} <= {(192, 144)}  # the other sections' pictures only


def test_kivi_decode_memory_follows_the_section_not_its_group(small_kv):
    """Found by the long fuzz run: a kivi config with group 65535 (valid) padded every 32-token section to 65535
    tokens before dequantizing, 132 MiB for 0.2 MB of output.  Measured in the fuzz child, against SPEC §9.1."""
    data = kvcodec.encode(small_kv, "kivi", bits=2, group=65536, chunk_tokens=32)
    worker = Worker([data], 2 << 30)
    try:
        for path in ("decode", "open"):
            r = worker.run((path, data, 0, None), 60)
            assert r["outcome"] == "decoded", r["detail"]
            assert r["peak"] < (1 << 20) + 8 * r["declared"], (path, r["peak"])
            assert r["peak"] < memory_bound(r["declared"], None, len(data), header_length(data))
    finally:
        worker.stop()
    assert torch.equal(kvcodec.decode(data).layers[0].keys,
                       kvcodec.decode(kvcodec.encode(small_kv, "kivi", bits=2, group=128, chunk_tokens=32)).layers[0].keys)


# ----------------------------------------------------------------------------------------- the caller's limit


def test_max_bytes_refuses_larger_decodes_before_allocating(small_kv):
    data = kvcodec.encode(small_kv, "zstd", chunk_tokens=32)
    out = sum(l.keys.numel() + l.values.numel() for l in small_kv.layers) * 2
    assert every_path(data, max_bytes=out) == [None, None, None]
    errors = every_path(data, max_bytes=out - 1)
    assert isinstance(errors[0], LimitExceededError) and isinstance(errors[2], LimitExceededError)
    assert errors[1] is None  # chunk by chunk, each chunk fits
    with kvcodec.open(data, max_bytes=1000) as r:
        with pytest.raises(LimitExceededError, match="max_bytes=1000"):
            r.read_chunk(0)
    assert all(isinstance(e, LimitExceededError) for e in every_path(data, max_bytes=100))  # the header alone
    part = kvcodec.decode(data, layers=[2], max_bytes=out // 3)  # a selection is measured by what it asks for
    assert part.layers[0].keys.shape == small_kv.layers[2].keys.shape
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(InvalidInputError):
            kvcodec.decode(data, max_bytes=bad)


def test_stream_refuses_a_section_over_max_bytes_before_buffering_it():
    """Layer 0 (16 kB) fits the limit; layer 1's 128 kB section is refused from its table entry."""
    layers = [(torch.ones(h, 2000, 2, dtype=torch.float16),) * 2 for h in (1, 8)]
    data = kvcodec.encode(kvcodec.KVCache(layers), "raw", chunk_tokens=2000)
    received = []

    def source():
        for at in range(0, len(data), 1000):
            received.append(at)
            yield data[at:at + 1000]

    with pytest.raises(LimitExceededError, match="section of layer 1"):
        kvcodec.decode(source(), max_bytes=20_000, layers=[0])
    assert received[-1] < 20_000  # long before the 128 kB section arrived


# ----------------------------------------------------------------------------------------- a short fuzz run


def test_short_fuzz_run_finds_only_kvcodec_errors_and_decodes(seeds):
    """30 mutated files per seed (kvtc's over a calibration fitted on the seed cache), each through all three
    paths in a child process (10 s, 2 GiB over its start); every decoder's own checks must be reached (``in codec``)."""
    tally = fuzz(seeds, hevc_donors(), cases=30 * len(seeds), rng_seed=14)
    assert not tally.bugs, [(b["seed"], b["path"], b["mutation"], b["outcome"], b["detail"][-500:]) for b in tally.bugs]
    for (seed, path), counts in tally.counts.items():
        assert counts["KVCodecError"] > 0 and counts["decoded"] + counts["KVCodecError"] == 30, (seed, path, counts)
        assert counts["in codec"] > 0, f"no mutation of {seed} reached its decoder's own checks via {path}"
