"""kvcodec.models: loading the models kvcodec runs itself."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvcodec import models

gguf = pytest.importorskip("gguf")


def _smollm2_tensors() -> list:
    folder, name = models.resolve(models.SMOLLM2)
    return gguf.GGUFReader(os.path.join(folder, name)).tensors


def test_a_quantized_tensor_dequantized_by_rows_equals_it_dequantized_whole():
    tensors = [t for t in _smollm2_tensors() if t.data.dtype == np.uint8 and t.data.shape[0] > 1000]
    assert {t.name for t in tensors} >= {"token_embd.weight"}
    whole = gguf.dequantize
    for t in tensors[:4]:
        expected = whole(t.data, t.tensor_type)
        with models._dequantized_by_rows(rows=1000):  # not a divisor: the last piece is short
            got = gguf.dequantize(t.data, t.tensor_type)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), t.name
    assert gguf.dequantize is whole


def test_float_tensors_are_not_copied_and_the_dequantize_is_put_back_after_an_error():
    tensor = next(t for t in _smollm2_tensors() if t.data.dtype == np.float32)
    whole = gguf.dequantize
    with pytest.raises(RuntimeError):
        with models._dequantized_by_rows(rows=1):
            assert np.shares_memory(gguf.dequantize(tensor.data, tensor.tensor_type), tensor.data)
            raise RuntimeError("a failed load")
    assert gguf.dequantize is whole
