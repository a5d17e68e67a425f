"""The ``threads`` option: validated, applied during the call only, and without effect on the bytes."""

from __future__ import annotations

import pytest
import torch

import kvcodec
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
