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


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """SmolLM2's real weights as a HuggingFace folder stored in bfloat16 (what most published models ship)."""
    from kvcodec.tools.models import export_hf_folder

    return export_hf_folder(models.SMOLLM2, tmp_path_factory.mktemp("models") / "smollm2-bf16")


def test_stored_weights_stay_bfloat16_and_compute_what_the_float32_load_computes(bf16_folder):
    import torch

    from kvcodec.cache import same_bits

    stored = models.load_model(bf16_folder, progress=False, cached=False, stored_weights=True)
    full = models.load_model(bf16_folder, progress=False, cached=False)
    assert {p.dtype for p in stored.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in full.model.parameters()} == {torch.float32} and stored.dtype == torch.float32
    ids = stored.tokenize(open("/usr/share/common-licenses/GPL-3").read())[:200]
    a, b = stored.prefill(ids[:150]), full.prefill(ids[:150])
    assert a.layers[0].keys.dtype == torch.float32
    assert all(same_bits(x.keys, y.keys) and same_bits(x.values, y.values) for x, y in zip(a.layers, b.layers))
    assert torch.equal(stored.continue_from(a, ids[150:]), full.continue_from(b, ids[150:]))
    assert {p.dtype for p in stored.model.parameters()} == {torch.bfloat16}  # put back after every use


def test_stored_weights_are_put_back_when_a_module_raises(bf16_folder):
    import torch

    stored = models.load_model(bf16_folder, progress=False, cached=False, stored_weights=True)
    with pytest.raises(IndexError):
        stored.model.model.embed_tokens(torch.tensor([[10 ** 9]]))  # a token id past the vocabulary
    assert stored.model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_float32_or_mixed_folder_is_loaded_in_float32(tmp_path, smollm2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(smollm2.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "f32")
    model.model.layers[0].mlp.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "mixed")
    for name in ("f32", "mixed"):
        smollm2.tokenizer.save_pretrained(tmp_path / name)
        loaded = models.load_model(str(tmp_path / name), progress=False, cached=False, stored_weights=True)
        assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}, name
