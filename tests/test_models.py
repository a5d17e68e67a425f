"""kvcodec.models: loading the models kvcodec runs itself."""

from __future__ import annotations

import os
import sys

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


def test_regression_a_model_folder_loaded_without_the_gguf_package(tmp_path, smollm2, monkeypatch):
    # the rows-at-a-time dequantize imported gguf for every model, so a folder failed where gguf is not installed
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(smollm2.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now fails
    loaded = models.load_model(str(tmp_path), progress=False, cached=False)
    assert loaded.prefill(loaded.tokenize("a folder's model")).num_tokens > 0
