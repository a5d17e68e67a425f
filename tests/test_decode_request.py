"""One decode pipeline: every entry point builds a DecodeRequest, each check runs once, and ``threads`` reaches the
codecs as an argument, not through torch's global setting."""

from __future__ import annotations

import collections

import pytest
import torch

import kvcodec
import kvcodec.chunking
from kvcodec.codecs.kvfetcher import codec as kvfetcher_codec
from kvcodec.codecs.raw import Raw
from kvcodec.errors import DeviceUnavailableError, InvalidInputError
from kvcodec.reader import iter_chunk_layers


def small_cache(tokens: int = 20) -> kvcodec.KVCache:
    g = torch.Generator().manual_seed(0)
    return kvcodec.KVCache([(torch.randn(2, tokens, 4, generator=g).half(), torch.randn(2, tokens, 4, generator=g).half())
                            for _ in range(3)], model="tiny", rope="post")


def entry_points(blob: bytes) -> dict[str, object]:
    """Each decode entry point as a function of the decode's keyword arguments (chunk 1 for the chunk readers)."""
    def chunk_layers(**options):
        with kvcodec.open(blob) as r:
            return list(iter_chunk_layers(r, 1, **options))

    def read_chunk(**options):
        with kvcodec.open(blob) as r:
            return r.read_chunk(1, **options)

    def reader_decode(**options):
        with kvcodec.open(blob) as r:
            return r.decode(**options)

    return {"bytes": lambda **o: kvcodec.decode(blob, **o), "stream": lambda **o: kvcodec.decode(iter([blob]), **o),
            "Reader.decode": reader_decode, "read_chunk": read_chunk, "iter_chunk_layers": chunk_layers}


@pytest.mark.parametrize("bad, error, match", [
    ({"device": "meta"}, DeviceUnavailableError, "the meta device holds no data"),
    ({"threads": 0}, InvalidInputError, "threads must be a positive integer, not 0"),
    ({"layers": [7]}, InvalidInputError, "layer 7 does not exist"),
    ({"backend": "gpu"}, InvalidInputError, "backend must be one of"),
    ({"positions": range(3)}, InvalidInputError, "3 positions for the 4 tokens decoded")])
def test_a_bad_argument_is_the_same_error_from_every_entry_point(bad, error, match):
    blob = kvcodec.encode(small_cache(4), chunk_tokens=2)  # 4 tokens: chunk 1 holds tokens 2..4, the decodes 0..4
    for name, decode in entry_points(blob).items():
        if name == "iter_chunk_layers" and "device" not in bad:
            continue  # it takes only a device
        with pytest.raises(error, match=match if "positions" not in bad or name != "read_chunk" else
                           "3 positions for the 2 tokens decoded"):
            decode(**bad)


def test_each_check_runs_once_per_decode(monkeypatch):
    calls: collections.Counter[str] = collections.Counter()
    for name in ("resolve_device", "check_threads", "check_backend", "check_layers", "check_output"):
        def counted(*args, _name=name, _fn=getattr(kvcodec.chunking, name)):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(kvcodec.chunking, name, counted)
    blob = kvcodec.encode(small_cache(), chunk_tokens=4)  # 5 chunks of 3 layers
    for name, decode in entry_points(blob).items():
        calls.clear()
        decode() if name == "iter_chunk_layers" else decode(threads=2)
        assert set(calls.values()) == {1} and len(calls) == 5, (name, calls)
    calls.clear()
    with kvcodec.open(blob) as r:
        r.verify(threads=2)
    assert calls == {"resolve_device": 1, "check_threads": 1, "check_backend": 1, "check_layers": 1,
                     "check_output": 5}  # the output of each chunk in turn


def test_threads_reach_the_codec_in_its_context_not_through_torch(monkeypatch):
    seen: list[tuple[int, int]] = []
    encode_layer, decode_layer = Raw.encode_layer, Raw.decode_layer

    def encoding(self, keys, values, ctx):
        seen.append((ctx.threads, torch.get_num_threads()))
        return encode_layer(self, keys, values, ctx)

    def decoding(self, data, ctx):
        seen.append((ctx.threads, torch.get_num_threads()))
        return decode_layer(self, data, ctx)

    monkeypatch.setattr(Raw, "encode_layer", encoding)
    monkeypatch.setattr(Raw, "decode_layer", decoding)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        blob = kvcodec.encode(small_cache(), chunk_tokens=4, threads=2)
        assert set(seen) == {(2, 2)}  # the codec's own value, and torch on it during the codec's call only
        for name, decode in entry_points(blob).items():
            seen.clear()
            decode() if name == "iter_chunk_layers" else decode(threads=2)
            assert seen and set(seen) == ({(1, 1)} if name == "iter_chunk_layers" else {(2, 2)}), name
            assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_kvfetcher_codes_as_many_sections_at_once_as_the_call_says(monkeypatch):
    workers: list[int] = []
    pool = kvfetcher_codec.section_pool

    def counting(n):
        workers.append(n)
        return pool(n)

    monkeypatch.setattr(kvfetcher_codec, "section_pool", counting)
    g = torch.Generator().manual_seed(3)
    kv = kvcodec.KVCache([(torch.randn(3, 64, 64, generator=g).half(), torch.randn(3, 64, 64, generator=g).half())
                          for _ in range(3)], model="SmolLM2-135M-Instruct")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # what the old code read back: one worker
    try:
        blob = kvcodec.encode(kv, "kvfetcher", threads=2)
        kvcodec.decode(blob, threads=3)
    finally:
        torch.set_num_threads(before)
    assert workers == [2, 3]


def test_a_registered_codec_supplies_the_rotary_setting_for_new_positions(monkeypatch):
    """``decode(positions=)`` once knew a model's rotary setting only from kvtc's installed calibrations (chunking
    imported kvtc); now any registered codec that has one installed for the model supplies it
    (:meth:`Codec.installed_rotary`), through the codec interface."""
    import numpy as np

    from kvcodec.codecs import registry
    from kvcodec.positions import Rotary

    rot = Rotary(np.array([1.0, 0.25]))  # a head of 4 channels: two rotary pairs

    class Rotating(Raw):
        codec_id = "test-rotating"

        @classmethod
        def installed_rotary(cls, model):
            return [rot] * 3 if model == "tiny" else None

    kv = small_cache()
    blob = kvcodec.encode(kv, "raw")
    with pytest.raises(InvalidInputError, match="no rotary setting"):
        kvcodec.decode(blob, positions=range(100, 120))
    monkeypatch.setitem(registry._registry, Rotating.codec_id, Rotating)
    moved = kvcodec.decode(blob, positions=range(100, 120))
    for got, layer in zip(moved.layers, kv.layers):
        assert torch.equal(got.keys, rot.move(layer.keys, torch.arange(20), torch.arange(100, 120)).half())
        assert torch.equal(got.values, layer.values)
    assert moved.positions == list(range(100, 120)) and not torch.equal(moved.layers[0].keys, kv.layers[0].keys)
