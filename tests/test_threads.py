"""The ``threads`` option: validated, applied during the call only, and without effect on the bytes."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import kvcodec
from kvcodec.codecs.registry import codec_class
from kvcodec.threads import torch_threads


def cache() -> kvcodec.KVCache:
    g = torch.Generator().manual_seed(3)
    return kvcodec.KVCache([(torch.randn(3, 300, 64, generator=g).half(), torch.randn(3, 300, 64, generator=g).half())
                            for _ in range(3)], model="SmolLM2-135M-Instruct")


@pytest.mark.parametrize("codec", ["kivi", "cachegen", "kvfetcher"])
def test_threads_do_not_change_bytes_and_are_restored(codec):
    kv = cache()
    with torch_threads(3):  # the caller's own setting: neither 1 nor 2, nor whatever an earlier test left
        one = kvcodec.encode(kv, codec, threads=1)
        seen, pieces = [], []
        for piece in kvcodec.iter_encode(kv, codec, threads=2):
            seen.append(torch.get_num_threads())
            pieces.append(piece)
        assert one == b"".join(pieces) and set(seen) == {3}  # between pieces, the caller's own setting is in force
        assert kvcodec.decode(one, threads=2).equal(kvcodec.decode(one, threads=1))
        assert torch.get_num_threads() == 3


def test_torch_threads_restores_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(ZeroDivisionError):
        with torch_threads(before + 1):
            assert torch.get_num_threads() == before + 1
            1 / 0
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_threads_are_invalid_input(bad):
    kv = cache()
    with pytest.raises(kvcodec.InvalidInputError, match="threads"):
        kvcodec.encode(kv, "raw", threads=bad)
    with pytest.raises(kvcodec.InvalidInputError, match="threads"):
        kvcodec.decode(kvcodec.encode(kv), threads=bad)


@pytest.fixture()
def engine_that_binds_threads(monkeypatch, caplog):
    """torch.set_num_threads as vLLM's CPU worker leaves it once it has bound its threads (vllm/v1/worker/
    cpu_worker.py): a warning, nothing set; the engine's own threads run torch on 3."""
    def skip_set_num_threads(n: int) -> None:
        logging.getLogger("engine").warning("CPU backend doesn't allow to use `torch.set_num_threads` after the "
                                            "thread binding, skip it.")

    with torch_threads(3):
        monkeypatch.setattr(torch, "set_num_threads", skip_set_num_threads)
        caplog.set_level(logging.WARNING)
        yield caplog
        monkeypatch.undo()


def counted(monkeypatch, codec: str) -> list[tuple[str, int]]:
    """(method, torch's thread count inside it) for each call of the codec's encode and decode methods."""
    cls, seen = codec_class(codec), []

    def counting(name, fn):
        def wrapped(self, *args, **kwargs):
            seen.append((name, torch.get_num_threads()))
            return fn(self, *args, **kwargs)
        return wrapped

    for name in ("encode_layer", "encode_layers", "decode_layer", "decode_layers"):
        monkeypatch.setattr(cls, name, counting(name, getattr(cls, name)))
    return seen


@pytest.mark.parametrize("codec", ["kivi", "cachegen", "kvfetcher"])
def test_engine_that_binds_threads_gets_no_set_num_threads_warnings_and_threads_applied(
        engine_that_binds_threads, monkeypatch, codec):
    """Issue 35, item 1: inside vLLM's CPU build every codec call logged two warnings and ran on the engine's count.
    Neither on the engine's own thread (a save) nor on a thread that is not kvcodec's (a load's)."""
    kv = cache()
    want = kvcodec.decode(kvcodec.encode(kv, codec, threads=1), threads=1)
    seen = counted(monkeypatch, codec)
    blob = kvcodec.encode(kv, codec, threads=2)
    loaded: list[kvcodec.KVCache] = []
    loader = threading.Thread(target=lambda: loaded.append(kvcodec.decode(blob, threads=2)))
    loader.start()
    loader.join()
    assert loaded[0].equal(want)
    assert [r.getMessage() for r in engine_that_binds_threads.records] == []
    # kvfetcher codes 2 sections at once, each with torch on one thread; the others run torch on 2 in every call
    section = 1 if codec == "kvfetcher" else 2
    assert {"encode", "decode"} <= {name[:6] for name, _ in seen}
    assert all(count == (2 if name.endswith("s") else section) for name, count in seen), seen
    assert torch.get_num_threads() == 3  # the engine's own thread kept its count
