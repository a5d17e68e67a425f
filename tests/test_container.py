"""The container format: round trips, determinism, streaming, random access and damage.

Everything here uses small synthetic caches; what is checked is the format, not a model.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import (CorruptDataError, InvalidInputError, KVCache, KVCodecError, UnknownCodecError,
                     UnsupportedVersionError)
from kvcodec.container import Frame, iter_frames, write_container
from kvcodec.formats import v1

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT = {4: (torch.int32, np.uint32, np.int32), 2: (torch.int16, np.uint16, np.int16)}
# NaNs with payloads (quiet, signalling, negative), +-inf, -0.0, smallest subnormal, largest finite
_SPECIAL = {
    torch.float32: [0x7FC00001, 0x7F800001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x7F7FFFFF],
    torch.float16: [0x7E01, 0x7C01, 0xFE55, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x7BFF],
    torch.bfloat16: [0x7FC1, 0x7F81, 0xFFC5, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x7F7F],
}
def slow(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def bits_tensor(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs, infs and subnormals included), plus every special pattern
    when there is room for them."""
    n = math.prod(shape)
    itype, utype, stype = _INT[dtype.itemsize]
    bits = 8 * dtype.itemsize
    ints = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n,), generator=gen, dtype=torch.int64).to(itype)
    special = torch.from_numpy(np.array(_SPECIAL[dtype], dtype=utype).view(stype).copy())
    if n:
        where = torch.randint(0, n, (min(n, len(special)),), generator=gen)
        ints[where] = special[: len(where)]
    return ints.view(dtype).reshape(shape)


def normal_tensor(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


@st.composite
def caches(draw, dtypes=tuple(DTYPES), max_layers=5, max_tokens=40, max_heads=5, max_dim=70, meta="all",
           content="bits"):
    """A KVCache of odd shapes: per-layer heads and head sizes, keys and values of different head_dim,
    layers with fewer tokens (sliding windows, possibly none)."""
    dtype = draw(st.sampled_from(dtypes))
    num_layers = draw(st.integers(1, max_layers))
    longest = draw(st.integers(0, max_tokens))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    make = bits_tensor if content == "bits" else normal_tensor
    layers = []
    for _ in range(num_layers):
        heads = draw(st.integers(1, max_heads))
        dk = draw(st.integers(1, max_dim))
        dv = draw(st.one_of(st.just(dk), st.integers(1, max_dim)))
        tokens = draw(st.one_of(st.just(longest), st.integers(0, longest)))
        layers.append((make(gen, (heads, tokens, dk), dtype), make(gen, (heads, tokens, dv), dtype)))
    n = max(k.shape[1] for k, _ in layers)
    kw = {}
    if meta in ("all", "no_positions"):
        if draw(st.booleans()):
            kw["model"] = draw(st.text(max_size=12))
        if draw(st.booleans()):
            kw["token_ids"] = draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n))
        kw["rope"] = draw(st.sampled_from([None, "pre", "post"]))
    if meta == "all" and draw(st.booleans()):
        kw["positions"] = draw(st.lists(st.integers(0, 2**20), min_size=n, max_size=n))
    return KVCache(layers, **kw)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return KVCache([(a, a)]).equal(KVCache([(b, b)])) if a.numel() or b.numel() else a.shape == b.shape


def assert_same(out: KVCache, kv: KVCache, meta: bool = True) -> None:
    assert out.shapes == kv.shapes
    assert out.dtype == kv.dtype
    assert out.equal(kv)
    if meta:
        assert out.meta == kv.meta


def local_range(kv: KVCache, layer: int, t0: int, tn: int) -> tuple[int, int]:
    """The slice of ``layer``'s token axis that global tokens ``t0 .. t0+tn`` cover (right-aligned)."""
    shift = kv.num_tokens - kv.layers[layer].keys.shape[1]
    return max(t0 - shift, 0), max(t0 + tn - shift, 0)


def expected_slots(kv: KVCache, chunk_tokens: int, chunk_layers: int | None) -> list[tuple[int, int, int, int]]:
    cl = kv.num_layers if chunk_layers is None else chunk_layers
    out = []
    for b in range(math.ceil(kv.num_tokens / chunk_tokens)):
        t0 = b * chunk_tokens
        for l0 in range(0, kv.num_layers, cl):
            out.append((t0, min(chunk_tokens, kv.num_tokens - t0), l0, min(cl, kv.num_layers - l0)))
    return out


def selection(kv: KVCache, layers, a: int, b: int) -> KVCache:
    """What decoding global tokens ``a .. b`` of ``layers`` gives: each layer's own slice of that range, and
    token_ids/positions of the range, cut to the last tokens when the selected layers hold fewer."""
    out = []
    for j in layers:
        lo, hi = local_range(kv, j, a, b - a)
        out.append((kv.layers[j].keys[:, lo:hi], kv.layers[j].values[:, lo:hi]))
    n = max(k.shape[1] for k, _ in out)
    meta = dict(kv.meta)
    for key in ("token_ids", "positions"):
        if key in meta:
            seq = meta[key][a:b]
            meta[key] = seq[len(seq) - n:]
    return KVCache(out, **meta)


def split(blob: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(blob)})
    edges = [0, *points, len(blob)]
    return [blob[a:b] for a, b in zip(edges, edges[1:])]


def small_cache(dtype=torch.float16, seed=0) -> KVCache:
    """2 layers, 2 heads, 20 tokens, head_dim 4."""
    g = torch.Generator().manual_seed(seed)
    return KVCache([(torch.randn(2, 20, 4, generator=g).to(dtype), torch.randn(2, 20, 4, generator=g).to(dtype))
                    for _ in range(2)], model="tiny", token_ids=list(range(20)), rope="post")


def rewrite_header(blob: bytes, **changes) -> bytes:
    """Rebuild ``blob`` with its header changed (checksums and index recomputed), frames kept."""
    header, frames = iter_frames([blob])
    frames = [Frame(h.variant, h.token_start, h.token_count, h.layer_start, sections) for h, sections in frames]
    return b"".join(write_container(dataclasses.replace(header, **changes), frames))


def patch_preamble(blob: bytes, *, major: int | None = None, minor: int | None = None) -> bytes:
    """Change the version fields and recompute the header checksum (which covers the preamble)."""
    magic, ma, mi, hlen = v1.PREAMBLE.unpack_from(blob)
    pre = v1.PREAMBLE.pack(magic, ma if major is None else major, mi if minor is None else minor, hlen)
    end = v1.PREAMBLE.size + hlen
    header_json = blob[v1.PREAMBLE.size:end]
    return pre + header_json + v1.CHECKSUM.pack(v1.checksum(pre, header_json)) + blob[end + v1.CHECKSUM.size:]


# ---------------------------------------------------------------------------------------------- round trips


@slow(60)
@given(kv=caches(), chunk_tokens=st.integers(1, 48), chunk_layers=st.one_of(st.none(), st.integers(1, 6)))
def test_raw_round_trip_is_bit_exact(kv, chunk_tokens, chunk_layers):
    blob = kvcodec.encode(kv, "raw", chunk_tokens=chunk_tokens, chunk_layers=chunk_layers)
    assert_same(kvcodec.decode(blob), kv)
    assert_same(kvcodec.decode(iter([blob])), kv)
    with kvcodec.open(blob) as r:
        assert [tuple(x) for x in ((e.token_start, e.token_count, e.layer_start, e.layer_count) for e in r.chunks)] \
            == expected_slots(kv, chunk_tokens, chunk_layers)
        info = r.info
        assert info.codec == "raw" and info.dtype == str(kv.dtype).removeprefix("torch.")
        assert info.layers == kv.shapes and info.num_tokens == kv.num_tokens
        assert info.file_size == len(blob)
        r.verify()


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_round_trip_special_values_every_dtype(dtype):
    gen = torch.Generator().manual_seed(7)
    kv = KVCache([(bits_tensor(gen, (3, 33, 5), dtype), bits_tensor(gen, (3, 33, 9), dtype)),
                  (bits_tensor(gen, (1, 4, 70), dtype), bits_tensor(gen, (1, 4, 1), dtype))])
    # the input really holds the awkward patterns
    k = kv.layers[0].keys.float()
    assert torch.isnan(k).any() and torch.isinf(k).any()
    assert (torch.signbit(kv.layers[0].keys.float()) & (kv.layers[0].keys.float() == 0)).any()
    for ct in (1, 8, 64):
        blob = kvcodec.encode(kv, chunk_tokens=ct, chunk_layers=1)
        assert_same(kvcodec.decode(blob), kv)
        assert_same(kvcodec.decode(iter(split(blob, list(range(0, len(blob), 97))))), kv)


def test_all_layers_empty_and_some_layers_empty():
    gen = torch.Generator().manual_seed(1)
    empty = KVCache([(torch.empty(2, 0, 3), torch.empty(2, 0, 5)), (torch.empty(1, 0, 4), torch.empty(1, 0, 4))],
                    token_ids=[], positions=[], rope="pre")
    blob = kvcodec.encode(empty, chunk_tokens=4)
    with kvcodec.open(blob) as r:
        assert r.num_chunks == 0
    for out in (kvcodec.decode(blob), kvcodec.decode(iter([blob]))):
        assert_same(out, empty)
    some = KVCache([(bits_tensor(gen, (2, 9, 3), torch.float32), bits_tensor(gen, (2, 9, 3), torch.float32)),
                    (torch.empty(2, 0, 3), torch.empty(2, 0, 3)),
                    (bits_tensor(gen, (2, 2, 3), torch.float32), bits_tensor(gen, (2, 2, 3), torch.float32))])
    blob = kvcodec.encode(some, "raw", chunk_tokens=4, chunk_layers=2)
    assert_same(kvcodec.decode(blob), some)
    assert_same(kvcodec.decode(iter([blob])), some)
    # layer 1 holds no tokens: its section in every chunk is empty, and it decodes to an empty layer
    chunk = kvcodec.open(blob).read_chunk(0)
    assert set(chunk.layers) == {0}
    lossy = KVCache([(torch.randn(l.keys.shape, generator=gen), torch.randn(l.values.shape, generator=gen))
                     for l in some.layers])
    out = kvcodec.decode(kvcodec.encode(lossy, "kivi", bits=2, chunk_tokens=4, chunk_layers=2))
    assert out.shapes == lossy.shapes and out.layers[1].keys.shape == (2, 0, 3)


def test_kivi_round_trip_shapes_and_meta():
    gen = torch.Generator().manual_seed(3)
    kv = KVCache([(torch.randn(3, 21, 7, generator=gen), torch.randn(3, 21, 5, generator=gen)),
                  (torch.randn(1, 6, 7, generator=gen), torch.randn(1, 6, 2, generator=gen))],
                 model="m", token_ids=list(range(21)), rope="pre", positions=list(range(5, 26)))
    blob = kvcodec.encode(kv, "kivi", bits=8, group=4, chunk_tokens=5, chunk_layers=1)
    for out in (kvcodec.decode(blob), kvcodec.decode(iter([blob]))):
        assert out.shapes == kv.shapes and out.dtype == kv.dtype and out.meta == kv.meta
        for a, b in zip(out.layers, kv.layers):
            assert torch.allclose(a.keys, b.keys, atol=0.05) and torch.allclose(a.values, b.values, atol=0.05)
    assert kvcodec.open(blob).info.config == {"bits": 8, "group": 4}


def test_save_load_file_paths_and_file_objects(tmp_path):
    kv = small_cache(torch.bfloat16)
    path = tmp_path / "kv.kvc"
    n = kvcodec.save(path, kv, "raw", chunk_tokens=8)
    blob = kvcodec.encode(kv, "raw", chunk_tokens=8)
    assert n == len(blob) == path.stat().st_size and path.read_bytes() == blob
    assert_same(kvcodec.load(path), kv)
    assert_same(kvcodec.load(str(path)), kv)
    with open(path, "rb") as f:
        assert_same(kvcodec.decode(f), kv)
    assert_same(kvcodec.decode(io.BytesIO(blob)), kv)
    assert_same(kvcodec.decode(bytearray(blob)), kv)
    assert_same(kvcodec.decode(memoryview(blob)), kv)
    assert [p.name for p in tmp_path.iterdir()] == ["kv.kvc"]  # no temporary left behind


def test_save_failure_leaves_no_file(tmp_path):
    kv = small_cache()
    with pytest.raises(InvalidInputError):
        kvcodec.save(tmp_path / "x.kvc", kv, "kivi", bits=3)
    with pytest.raises(InvalidInputError):
        kvcodec.save(tmp_path / "x.kvc", KVCache([(torch.full((1, 2, 2), float("nan")), torch.zeros(1, 2, 2))]),
                     "kivi")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- determinism

_DIGESTS = '''
def digests():
    import hashlib, torch, kvcodec
    g = torch.Generator().manual_seed(1234)
    layers = []
    for h, t, dk, dv in [(2, 37, 5, 7), (3, 20, 8, 8), (1, 0, 3, 4)]:
        layers.append((torch.randn(h, t, dk, generator=g).to(torch.float16),
                       torch.randn(h, t, dv, generator=g).to(torch.float16)))
    kv = kvcodec.KVCache(layers, model="m", token_ids=list(range(37)), rope="post", positions=list(range(100, 137)))
    out = {}
    for name, codec, opts in [("raw", "raw", {}), ("kivi2", "kivi", {"bits": 2, "group": 8}),
                              ("kivi4", "kivi", {"bits": 4, "group": 128})]:
        out[name] = hashlib.sha256(kvcodec.encode(kv, codec, chunk_tokens=16, chunk_layers=2, **opts)).hexdigest()
    return out
'''


def _digests() -> dict[str, str]:
    ns: dict = {}
    exec(_DIGESTS, ns)
    return ns["digests"]()


@pytest.mark.parametrize("codec,opts", [("raw", {}), ("kivi", {"bits": 2, "group": 8}), ("kivi", {"bits": 4}),
                                        ("kivi", {"bits": 8, "group": 3})])
def test_same_bytes_every_time(codec, opts):
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(4, 3, 26, 6, generator=gen)
    contiguous = KVCache([(base[0].contiguous(), base[1].contiguous()), (base[2][:, :13].contiguous(), base[3][:, :13].contiguous())],
                         model="x", token_ids=list(range(26)))
    # the same values held in non-contiguous views
    strided = torch.randn(3, 6, 4, 26, generator=gen).permute(2, 0, 3, 1).clone()  # [4, 3, 26, 6] via a permutation
    strided.copy_(base)
    views = KVCache([(strided[0], strided[1]), (strided[2][:, :13], strided[3][:, :13])],
                    model="x", token_ids=list(range(26)))
    assert not views.layers[0].keys.is_contiguous()
    first = kvcodec.encode(contiguous, codec, chunk_tokens=7, chunk_layers=1, **opts)
    assert kvcodec.encode(contiguous, codec, chunk_tokens=7, chunk_layers=1, **opts) == first
    assert b"".join(kvcodec.iter_encode(contiguous, codec, chunk_tokens=7, chunk_layers=1, **opts)) == first
    assert kvcodec.encode(views, codec, chunk_tokens=7, chunk_layers=1, **opts) == first
    assert kvcodec.encode(contiguous, kvcodec.get_codec(codec, **opts), chunk_tokens=7, chunk_layers=1) == first


def test_same_bytes_in_another_process():
    here = _digests()
    assert set(here) == {"raw", "kivi2", "kivi4"} and len(set(here.values())) == 3
    env = dict(os.environ, PYTHONHASHSEED="4242")
    code = _DIGESTS + "\nprint(repr(digests()))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout.strip()) == here


# ---------------------------------------------------------------------------------------------- streaming


@slow(40)
@given(kv=caches(max_layers=4, max_tokens=30, max_dim=20), codec=st.sampled_from(["raw", "kivi"]),
       chunk_tokens=st.integers(1, 32), chunk_layers=st.one_of(st.none(), st.integers(1, 4)), data=st.data())
def test_stream_decode_matches_bytes_decode(kv, codec, chunk_tokens, chunk_layers, data):
    if codec == "kivi":
        gen = torch.Generator().manual_seed(0)
        kv = KVCache([(normal_tensor(gen, l.keys.shape, kv.dtype), normal_tensor(gen, l.values.shape, kv.dtype))
                      for l in kv.layers], **kv.meta)
    opts = dict(chunk_tokens=chunk_tokens, chunk_layers=chunk_layers)
    pieces_out = list(kvcodec.iter_encode(kv, codec, **opts))
    blob = kvcodec.encode(kv, codec, **opts)
    assert b"".join(pieces_out) == blob
    assert len(pieces_out) > 1  # one piece per part, never the whole file at once
    whole = kvcodec.decode(blob)
    if codec == "raw":
        assert_same(whole, kv)
    cuts = data.draw(st.lists(st.integers(1, len(blob)), max_size=12))
    pieces = split(blob, cuts)
    if data.draw(st.booleans()):  # empty pieces anywhere are harmless
        pieces = [p for piece in pieces for p in (piece, b"")]
    assert b"".join(pieces) == blob
    streamed = kvcodec.decode(iter(pieces))
    assert_same(streamed, whole)
    assert_same(kvcodec.decode(kvcodec.iter_encode(kv, codec, **opts)), whole)


def test_stream_decode_one_byte_at_a_time():
    kv = small_cache(torch.float32)
    for codec, opts in (("raw", {}), ("kivi", {"bits": 4})):
        blob = kvcodec.encode(kv, codec, chunk_tokens=8, **opts)
        assert_same(kvcodec.decode(blob[i:i + 1] for i in range(len(blob))), kvcodec.decode(blob))


def test_stream_yields_each_chunk_as_soon_as_it_arrives():
    kv = small_cache()
    blob = kvcodec.encode(kv, chunk_tokens=8, chunk_layers=1)
    entries = kvcodec.open(blob).chunks
    pulled = 0

    def one_byte_pieces():
        nonlocal pulled
        for i in range(len(blob)):
            pulled += 1
            yield blob[i:i + 1]

    header, frames = iter_frames(one_byte_pieces())
    assert pulled == entries[0].offset  # the header alone
    assert header.chunk_tokens == 8 and header.chunk_layers == 1
    for e, (head, sections) in zip(entries, frames):
        assert pulled == e.offset + e.length  # nothing past this chunk was read
        assert (head.token_start, head.token_count, head.layer_start) == (e.token_start, e.token_count, e.layer_start)
        assert len(sections) == e.layer_count
    assert next(frames, None) is None  # then the index and footer are checked
    assert pulled == len(blob)


# ---------------------------------------------------------------------------------------------- random access


@slow(40)
@given(kv=caches(max_layers=5, max_tokens=30, max_dim=12), chunk_tokens=st.integers(1, 12),
       chunk_layers=st.one_of(st.none(), st.integers(1, 4)), data=st.data())
def test_read_chunk_and_selections_match_slices(kv, chunk_tokens, chunk_layers, data):
    blob = kvcodec.encode(kv, "raw", chunk_tokens=chunk_tokens, chunk_layers=chunk_layers)
    slots = expected_slots(kv, chunk_tokens, chunk_layers)
    r = kvcodec.open(blob)
    assert r.num_chunks == len(slots)
    for i, (t0, tn, l0, lc) in enumerate(slots):
        chunk = r.read_chunk(i)
        assert (chunk.index, chunk.token_start, chunk.token_count) == (i, t0, tn)
        want = {}
        for layer in range(l0, l0 + lc):
            lo, hi = local_range(kv, layer, t0, tn)
            if hi > lo:
                want[layer] = (kv.layers[layer].keys[:, lo:hi], kv.layers[layer].values[:, lo:hi])
        assert set(chunk.layers) == set(want)
        for layer, (k, v) in want.items():
            assert same_bits(chunk.layers[layer].keys, k) and same_bits(chunk.layers[layer].values, v)
        j = data.draw(st.integers(l0, l0 + lc - 1), label=f"layer of chunk {i}")
        one = r.read_chunk(i, layers=[j])
        assert set(one.layers) == ({j} & set(want))
        if j in want:
            assert same_bits(one.layers[j].keys, want[j][0]) and same_bits(one.layers[j].values, want[j][1])

    # whole-cache decode of a layer selection
    layers = data.draw(st.lists(st.integers(0, kv.num_layers - 1), min_size=1, max_size=4, unique=True))
    want = selection(kv, layers, 0, kv.num_tokens)
    assert_same(r.decode(layers=layers), want)
    assert_same(kvcodec.decode(blob, layers=layers), want)
    assert_same(kvcodec.decode(iter([blob]), layers=layers), want)

    if not slots:
        return
    # a contiguous run of token blocks, all layer groups of each
    blocks = math.ceil(kv.num_tokens / chunk_tokens)
    b0 = data.draw(st.integers(0, blocks - 1))
    b1 = data.draw(st.integers(b0, blocks - 1))
    picked = [i for i, s in enumerate(slots) if b0 * chunk_tokens <= s[0] <= b1 * chunk_tokens]
    a, b = b0 * chunk_tokens, min((b1 + 1) * chunk_tokens, kv.num_tokens)

    everything = selection(kv, range(kv.num_layers), a, b)
    assert_same(kvcodec.decode(blob, chunks=picked), everything)
    assert_same(r.decode(chunks=list(reversed(picked))), everything)
    assert_same(kvcodec.decode(blob, chunks=picked, layers=layers), selection(kv, layers, a, b))


def test_non_contiguous_chunk_selection_is_rejected():
    kv = small_cache()
    blob = kvcodec.encode(kv, chunk_tokens=8)  # chunks: tokens 0-8, 8-16, 16-20
    assert kvcodec.open(blob).num_chunks == 3
    with pytest.raises(InvalidInputError):
        kvcodec.decode(blob, chunks=[0, 2])
    with pytest.raises(InvalidInputError):
        kvcodec.open(blob).decode(chunks=[2, 0])
    with pytest.raises(InvalidInputError):
        kvcodec.decode(blob, chunks=[3])
    with pytest.raises(InvalidInputError):
        kvcodec.decode(blob, chunks=[-1])
    with pytest.raises(InvalidInputError):
        kvcodec.open(blob).read_chunk(3)
    with pytest.raises(InvalidInputError):
        kvcodec.decode(blob, layers=[2])
    with pytest.raises(InvalidInputError):
        kvcodec.decode(blob, layers=[-1])
    with pytest.raises(InvalidInputError):  # chunk selection needs random access
        kvcodec.decode(iter([blob]), chunks=[0])
    two = kvcodec.encode(kv, chunk_tokens=8, chunk_layers=1)
    with pytest.raises(InvalidInputError):  # chunk 0 holds layer 0 only
        kvcodec.open(two).read_chunk(0, layers=[1])
    assert_same(kvcodec.decode(blob, chunks=[1, 2, 1]), KVCache([(l.keys[:, 8:], l.values[:, 8:]) for l in kv.layers],
                                                             model="tiny", token_ids=list(range(8, 20)), rope="post"))


def test_chunk_selection_that_is_not_a_rectangle_is_invalid_input():
    """Chunks of one token range but different layer groups (chunk 0: tokens 0-8 of layers 0-1, chunk 3:
    tokens 8-16 of layers 2-3) cannot form a cache; that is the caller's mistake, not damage."""
    gen = torch.Generator().manual_seed(0)
    kv = KVCache([(torch.randn(2, 16, 4, generator=gen), torch.randn(2, 16, 4, generator=gen)) for _ in range(4)])
    blob = kvcodec.encode(kv, chunk_tokens=8, chunk_layers=2)
    with pytest.raises(InvalidInputError):
        kvcodec.decode(blob, chunks=[0, 3])
    with pytest.raises(InvalidInputError):  # chunk 0 does not hold layer 3
        kvcodec.decode(blob, chunks=[0], layers=[3])


def test_empty_layer_or_chunk_selection_is_invalid_input():
    blob = kvcodec.encode(small_cache(), chunk_tokens=8)
    with pytest.raises(InvalidInputError):
        kvcodec.decode(blob, layers=[])
    with pytest.raises(InvalidInputError):
        kvcodec.decode(blob, chunks=[])


def test_stream_decode_rejects_bad_layer_selection_as_invalid_input():
    blob = kvcodec.encode(small_cache(), chunk_tokens=8)
    out = kvcodec.decode(iter([blob]), layers=[1])
    assert_same(out, KVCache([small_cache().layers[1]], model="tiny", token_ids=list(range(20)), rope="post"))
    for layers in ([2], [99], [-1]):
        with pytest.raises(InvalidInputError):
            kvcodec.decode(iter([blob]), layers=layers)


def test_selecting_a_sliding_window_layer_with_positions_metadata():
    """Decoding only a layer that holds fewer tokens (a sliding window) of a cache that records positions."""
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(2, 20, 4, generator=gen), torch.randn(2, 20, 4, generator=gen))
    window = (torch.randn(2, 5, 4, generator=gen), torch.randn(2, 5, 4, generator=gen))
    kv = KVCache([full, window], positions=list(range(20)))
    blob = kvcodec.encode(kv, chunk_tokens=8)
    for out in (kvcodec.decode(blob, layers=[1]), kvcodec.decode(iter([blob]), layers=[1])):
        assert out.num_layers == 1 and same_bits(out.layers[0].keys, window[0]) and same_bits(out.layers[0].values, window[1])
        assert out.positions == list(range(15, 20))  # the window holds the last 5 tokens
    out = kvcodec.decode(blob, chunks=[1], layers=[1])  # tokens 8-16, of which the window holds 15
    assert out.positions == [15] and same_bits(out.layers[0].keys, window[0][:, :1])


class RecordingFile(io.BytesIO):
    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.reads: list[tuple[int, int]] = []

    def read(self, n: int = -1) -> bytes:
        pos = self.tell()
        out = super().read(n)
        self.reads.append((pos, len(out)))
        return out


@pytest.mark.parametrize("codec,opts", [("raw", {}), ("kivi", {"bits": 2, "group": 4})])
def test_read_chunk_reads_only_that_chunk(codec, opts):
    kv = small_cache(torch.float32)
    blob = kvcodec.encode(kv, codec, chunk_tokens=8, chunk_layers=1, **opts)
    expected = kvcodec.decode(blob)
    entries = kvcodec.open(blob).chunks
    assert len(entries) == 6

    f = RecordingFile(blob)
    r = kvcodec.open(f)
    for i, e in enumerate(entries):
        f.reads.clear()
        chunk = r.read_chunk(i)
        assert f.reads and all(e.offset <= pos and pos + n <= e.offset + e.length for pos, n in f.reads)
        lo, hi = e.token_start, e.token_start + e.token_count
        layer = expected.layers[e.layer_start]
        assert same_bits(chunk.layers[e.layer_start].keys, layer.keys[:, lo:hi])

    # damage the body of chunk 3 (tokens 8-16 of layer 1): the others still read, it and the whole do not
    bad = bytearray(blob)
    e = entries[3]
    bad[e.offset + v1.frame_head_size(1) + 5] ^= 0x40
    bad = bytes(bad)
    r = kvcodec.open(bad)  # header and index are intact
    for i in (0, 1, 2, 4, 5):
        chunk = r.read_chunk(i)
        ei = entries[i]
        layer = expected.layers[ei.layer_start]
        assert same_bits(chunk.layers[ei.layer_start].keys, layer.keys[:, ei.token_start:ei.token_start + ei.token_count])
    with pytest.raises(CorruptDataError):
        r.read_chunk(3)
    with pytest.raises(CorruptDataError):
        r.verify()
    with pytest.raises(CorruptDataError):
        kvcodec.decode(bad)
    with pytest.raises(CorruptDataError):
        kvcodec.decode(iter([bad]))
    with pytest.raises(CorruptDataError):
        kvcodec.decode(bad, layers=[1])
    # selections that avoid the damage still decode
    assert_same(kvcodec.decode(bad, layers=[0]), KVCache([expected.layers[0]], **expected.meta))
    first = kvcodec.decode(bad, chunks=[0, 1])
    assert same_bits(first.layers[1].values, expected.layers[1].values[:, :8])


# ---------------------------------------------------------------------------------------------- damage


def _corruption_blobs() -> list[tuple[str, bytes, KVCache]]:
    kv = small_cache(torch.float16)
    out = []
    for name, codec, opts in (("raw", "raw", {}), ("kivi2", "kivi", {"bits": 2})):
        blob = kvcodec.encode(kv, codec, chunk_tokens=8, **opts)
        out.append((name, blob, kvcodec.decode(blob)))
    return out


CORRUPTION_BLOBS = _corruption_blobs()
VERSION_FIELD = range(8, 10)  # the major version: a different one may be a newer format, not damage


def _check(fn, original: KVCache, allow_version: bool) -> str | None:
    """None if ``fn`` raised CorruptDataError or returned the original; otherwise what went wrong."""
    try:
        out = fn()
    except CorruptDataError:
        return None
    except UnsupportedVersionError:
        return None if allow_version else "UnsupportedVersionError"
    except Exception as e:  # noqa: BLE001 - anything else is a finding
        return f"{type(e).__name__}: {e}"
    if not (out.equal(original) and out.meta == original.meta):
        return "decoded to different data"
    return None


@pytest.mark.parametrize("name,blob,original", CORRUPTION_BLOBS, ids=[c[0] for c in CORRUPTION_BLOBS])
@pytest.mark.parametrize("path", ["bytes", "stream"])
def test_every_single_byte_flip_is_detected(name, blob, original, path):
    bad = []
    for pos in range(len(blob)):
        for mask in (0xFF, 0x01):
            damaged = bytearray(blob)
            damaged[pos] ^= mask
            damaged = bytes(damaged)
            if path == "bytes":
                fn = lambda d=damaged: kvcodec.decode(d)  # noqa: E731
            else:
                fn = lambda d=damaged: kvcodec.decode(iter([d[:pos // 2 + 1], d[pos // 2 + 1:]]))  # noqa: E731
            problem = _check(fn, original, pos in VERSION_FIELD)
            if problem:
                bad.append((pos, hex(mask), problem))
    assert not bad, f"{len(bad)} undetected or misreported flips, first: {bad[:5]}"


@pytest.mark.parametrize("name,blob,original", CORRUPTION_BLOBS, ids=[c[0] for c in CORRUPTION_BLOBS])
def test_random_access_reads_detect_flips(name, blob, original):
    """read_chunk and verify on damaged bytes: CorruptDataError or exactly the original chunk."""
    entries = kvcodec.open(blob).chunks
    bad = []
    for pos in range(len(blob)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0xFF
        damaged = bytes(damaged)
        for i, e in enumerate(entries):
            def fn(d=damaged, i=i, e=e):
                chunk = kvcodec.open(d).read_chunk(i)
                lo, hi = e.token_start, e.token_start + e.token_count
                return KVCache([(chunk.layers[j].keys, chunk.layers[j].values) for j in sorted(chunk.layers)]), \
                    KVCache([(l.keys[:, lo:hi], l.values[:, lo:hi]) for l in original.layers])
            try:
                got, want = fn()
            except (CorruptDataError, UnsupportedVersionError) as err:
                if isinstance(err, UnsupportedVersionError) and pos not in VERSION_FIELD:
                    bad.append((pos, i, repr(err)))
                continue
            except Exception as err:  # noqa: BLE001
                bad.append((pos, i, repr(err)))
                continue
            if not got.equal(want):
                bad.append((pos, i, "different data"))
    assert not bad, f"{len(bad)} problems, first: {bad[:5]}"


@pytest.mark.parametrize("name,blob,original", CORRUPTION_BLOBS, ids=[c[0] for c in CORRUPTION_BLOBS])
def test_truncation_at_every_offset_is_corrupt(name, blob, original):
    bad = []
    for n in range(len(blob)):
        cut = blob[:n]
        for path, fn in (("bytes", lambda: kvcodec.decode(cut)),
                         ("open", lambda: kvcodec.open(cut)),
                         ("stream", lambda: kvcodec.decode(iter([cut]))),
                         ("stream-bytewise", lambda: kvcodec.decode(iter(split(cut, [n // 3, 2 * n // 3]))))):
            try:
                fn()
            except CorruptDataError:
                continue
            except Exception as e:  # noqa: BLE001
                bad.append((n, path, repr(e)))
                continue
            bad.append((n, path, "no error"))
    assert not bad, f"{len(bad)} problems, first: {bad[:5]}"


@pytest.mark.parametrize("extra", [b"\x00", b"garbage", "footer", "twice", "index"])
def test_trailing_bytes_after_footer_are_rejected(extra):
    blob = CORRUPTION_BLOBS[0][1]
    tail = {"footer": blob[-v1.FOOTER.size:], "twice": blob, "index": blob[-64:]}.get(extra, extra)
    data = blob + tail
    with pytest.raises(CorruptDataError):
        kvcodec.decode(data)
    with pytest.raises(CorruptDataError):
        kvcodec.decode(iter([data]))
    with pytest.raises(CorruptDataError):
        kvcodec.decode(iter([blob, tail]))
    # empty pieces after the end are not bytes
    assert_same(kvcodec.decode(iter([blob, b"", b""])), CORRUPTION_BLOBS[0][2])


@pytest.mark.parametrize("data", [b"", b"\x89KVC", b"PK\x03\x04" + bytes(200), b"\x89KVD\r\n\x1a\n", "magic"])
def test_not_a_container_is_corrupt(data):
    if data == "magic":
        blob = CORRUPTION_BLOBS[0][1]
        data = b"\x89KVX" + blob[4:]
    with pytest.raises(CorruptDataError):
        kvcodec.decode(data)
    with pytest.raises(CorruptDataError):
        kvcodec.open(data)
    with pytest.raises(CorruptDataError):
        kvcodec.decode(iter([data]))


@pytest.mark.parametrize("name,blob,original", CORRUPTION_BLOBS, ids=[c[0] for c in CORRUPTION_BLOBS])
def test_newer_major_version_is_unsupported(name, blob, original):
    for major in (2, 3, 65535):
        data = patch_preamble(blob, major=major)
        for fn in (lambda: kvcodec.decode(data), lambda: kvcodec.open(data), lambda: kvcodec.decode(iter([data]))):
            with pytest.raises(UnsupportedVersionError) as info:
                fn()
            assert f"{major}.0" in str(info.value), str(info.value)
            assert not isinstance(info.value, CorruptDataError)
    # a newer minor version of the same major is read
    newer = patch_preamble(blob, minor=7)
    assert newer != blob
    assert_same(kvcodec.decode(newer), original)
    assert_same(kvcodec.decode(iter([newer])), original)


def test_unknown_codec_in_header_is_named():
    blob = CORRUPTION_BLOBS[0][1]
    data = rewrite_header(blob, variants=(v1.Variant("nosuch", {}),))
    assert b'"codec":"nosuch"' in data
    for fn in (lambda: kvcodec.decode(data), lambda: kvcodec.open(data), lambda: kvcodec.decode(iter([data]))):
        with pytest.raises(UnknownCodecError, match="nosuch"):
            fn()
    # the unchanged rebuild still decodes (the rewrite itself is sound)
    assert rewrite_header(blob) == blob


def test_invalid_codec_config_in_header_is_corrupt():
    blob = CORRUPTION_BLOBS[1][1]
    for config in ({"bits": 3, "group": 128}, {"bits": 2, "group": 128, "foo": 1}, {"bits": 2, "group": 0},
                   {"bits": 2}, {"bits": 2.0, "group": 128}, {"bits": True, "group": 128}):
        data = rewrite_header(blob, variants=(v1.Variant("kivi", config),))
        for fn in (lambda: kvcodec.decode(data), lambda: kvcodec.decode(iter([data]))):
            with pytest.raises(CorruptDataError):
                fn()


def test_header_that_disagrees_with_sections_is_corrupt():
    """A header whose checksums are right but whose shapes do not match the section sizes."""
    raw, kivi = CORRUPTION_BLOBS[0][1], CORRUPTION_BLOBS[1][1]
    cases = [(raw, {"dtype": "float32"}), (raw, {"variants": (v1.Variant("kivi", {"bits": 2, "group": 128}),)}),
             (kivi, {"variants": (v1.Variant("kivi", {"bits": 4, "group": 128}),)}),
             (kivi, {"variants": (v1.Variant("raw", {}),)}),
             (raw, {"layers": (v1.LayerShape(2, 20, 4, 4), v1.LayerShape(2, 20, 4, 5))}),
             (raw, {"layers": (v1.LayerShape(2, 20, 4, 4), v1.LayerShape(2, 19, 4, 4))})]
    for blob, changes in cases:
        data = rewrite_header(blob, **changes)
        for fn in (lambda: kvcodec.decode(data), lambda: kvcodec.decode(iter([data]))):
            with pytest.raises(CorruptDataError):
                fn()


@pytest.mark.parametrize("header_len", [v1.MAX_HEADER_BYTES + 1, 0x7FFFFFFF, 0xFFFFFFFF])
def test_oversized_header_length_is_rejected_without_allocating(header_len):
    blob = CORRUPTION_BLOBS[0][1]
    data = v1.PREAMBLE.pack(v1.MAGIC, 1, 0, header_len) + blob[v1.PREAMBLE.size:]
    pulled = 0

    def endless():
        nonlocal pulled
        yield data[:v1.PREAMBLE.size]
        while True:
            pulled += 1
            yield bytes(1 << 20)

    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match=str(header_len)):
            kvcodec.decode(data)
        with pytest.raises(CorruptDataError):
            kvcodec.decode(io.BytesIO(data))
        with pytest.raises(CorruptDataError):
            kvcodec.decode(endless())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pulled <= 1
    assert peak < 4 << 20, peak


# ---------------------------------------------------------------------------------------------- writer input


def _kv() -> KVCache:
    return small_cache(torch.float32)


@pytest.mark.parametrize("chunk_tokens", [0, -1, 2.5, "8", None, True, v1.MAX_CHUNK_TOKENS + 1])
def test_bad_chunk_tokens_is_invalid_input(chunk_tokens):
    with pytest.raises(InvalidInputError):
        kvcodec.encode(_kv(), chunk_tokens=chunk_tokens)
    with pytest.raises(InvalidInputError):  # raised at the call, before any byte is produced
        kvcodec.iter_encode(_kv(), chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("chunk_layers", [0, -1, 1.5, "1", v1.MAX_LAYERS + 1])
def test_bad_chunk_layers_is_invalid_input(chunk_layers):
    with pytest.raises(InvalidInputError):
        kvcodec.encode(_kv(), chunk_layers=chunk_layers)


def test_unknown_codec_at_encode():
    with pytest.raises(UnknownCodecError, match="nosuch"):
        kvcodec.encode(_kv(), "nosuch")
    with pytest.raises(UnknownCodecError, match="nosuch"):
        kvcodec.iter_encode(_kv(), "nosuch")
    assert issubclass(UnknownCodecError, KVCodecError)


@pytest.mark.parametrize("codec,opts", [("kivi", {"bits": 3}), ("kivi", {"bits": 1}), ("kivi", {"bits": 16}),
                                        ("kivi", {"bits": "4"}), ("kivi", {"foo": 1}), ("kivi", {"group": 0}),
                                        ("kivi", {"group": 1.5}), ("kivi", {"group": 1 << 17}), ("raw", {"bits": 4})])
def test_bad_codec_options_are_invalid_input(codec, opts):
    with pytest.raises(InvalidInputError):
        kvcodec.encode(_kv(), codec, **opts)
    with pytest.raises(InvalidInputError):
        kvcodec.get_codec(codec, **opts)


def test_unknown_option_is_named():
    with pytest.raises(InvalidInputError, match="foo"):
        kvcodec.encode(_kv(), "kivi", foo=1)


def test_float_kivi_bits_is_invalid_input():
    """bits=4.0 compares equal to 4 but is not an integer width."""
    with pytest.raises(InvalidInputError):
        kvcodec.encode(_kv(), "kivi", bits=4.0)


def test_codec_instance_with_options_is_invalid_input():
    with pytest.raises(InvalidInputError):
        kvcodec.encode(_kv(), kvcodec.get_codec("kivi"), bits=2)


@pytest.mark.parametrize("meta", [{"model": float("nan")}, {"model": object()}, {"model": 5}])
def test_unserialisable_metadata_is_invalid_input(meta):
    kv = _kv()
    kv.model = meta["model"]
    with pytest.raises(InvalidInputError):
        kvcodec.encode(kv)


def test_streamed_decode_passes_on_a_chunk_as_soon_as_nothing_better_can_follow():
    """A single-variant chunk is decoded without waiting for the next chunk's bytes; a lower variant waits
    for the next head (a better variant of the same chunk may follow)."""
    from types import SimpleNamespace

    from kvcodec.api import _best

    def frames(spec, pulled):
        for cell, variant in spec:
            pulled.append((cell, variant))
            yield SimpleNamespace(cell=cell, variant=variant), []

    pulled: list = []
    seen = []
    for head, _ in _best(frames([(0, 0), (1, 0), (2, 0)], pulled), 1):
        seen.append((head.cell, list(pulled)))
    assert seen == [(0, [(0, 0)]), (1, [(0, 0), (1, 0)]), (2, [(0, 0), (1, 0), (2, 0)])]
    # two variants: chunk 0 has both (the best passes at once), chunk 1 only the lower one (it waits for chunk 2)
    pulled = []
    out = [(h.cell, h.variant, len(pulled)) for h, _ in _best(frames([(0, 0), (0, 1), (1, 0), (2, 1)], pulled), 2)]
    assert out == [(0, 1, 2), (1, 0, 4), (2, 1, 4)]


def test_chunk_and_layer_reprs_are_short():
    kv = KVCache([(torch.zeros(3, 300, 64, dtype=torch.float16), torch.zeros(3, 300, 32, dtype=torch.float16))] * 4)
    reader = kvcodec.open(kvcodec.encode(kv))
    chunk = reader.read_chunk(1)
    assert repr(chunk) == ("Chunk(index=1, tokens 256-299, layers 0-3, layer 0: KVLayer(heads=3, tokens=44, key_dim=64, "
                           "value_dim=32, dtype=float16, device=cpu))")
    assert "layers 1,3," in repr(reader.read_chunk(0, layers=[1, 3]))
    assert len(str(chunk)) < 200 and "\n" not in str(chunk.layers[0])


def test_read_chunk_layer_selection_is_checked_like_decode():
    """An empty or out-of-range layer selection names the container's layers, on read_chunk as on decode."""
    kv = kvcodec.KVCache([(torch.randn(1, 8, 4), torch.randn(1, 8, 4))] * 3)
    with kvcodec.open(kvcodec.encode(kv, codec="raw", chunk_tokens=4)) as r:
        with pytest.raises(kvcodec.InvalidInputError, match="no layers selected"):
            r.read_chunk(0, layers=[])
        with pytest.raises(kvcodec.InvalidInputError, match="the container has 3 layers"):
            r.read_chunk(0, layers=[40])
        assert sorted(r.read_chunk(1, layers=[2]).layers) == [2]
