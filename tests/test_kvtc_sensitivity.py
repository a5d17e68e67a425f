"""kvtc's loss measurement (kvcodec.codecs.kvtc.sensitivity) on SmolLM2's real weights: its memory."""

from __future__ import annotations

import contextlib

import torch

from kvcodec.codecs.kvtc import sensitivity
from kvcodec.texts import load_text

SHORT = {"prefix_tokens": 128, "continuation_tokens": 96, "samples": 1}


def _saved_bytes(smollm2, recomputed: bool) -> int:
    """Bytes, other than the model's weights, that the autograd graph saves for the backward pass when the decoder
    stack continues a cache whose keys and values need their gradient, as the measurement's does."""
    model = smollm2.model
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = smollm2.tokenize(load_text("license:GPL-3"))[:224]
    kv = smollm2.prefill(ids[:128])
    for layer in kv.layers:
        layer.keys.requires_grad_()
        layer.values.requires_grad_()
    cache = kv.to_hf(model.config)
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            sensitivity._layers_recomputed(model.model, cache) if recomputed else contextlib.nullcontext():
        model.model(torch.tensor([ids[128:]]), use_cache=True, **smollm2._cache_arg(cache))
    return sum(saved)


def test_the_loss_measurement_keeps_each_layers_input_only_and_measures_the_same(smollm2, monkeypatch):
    # Regression (issue 36): the backward pass kept every layer's activations over the continuation, about 1.3 GB
    # on a 0.5B model over 512 tokens, its calibration's peak.
    recomputed = sensitivity.fisher_diagonals(smollm2, **SHORT)
    monkeypatch.setattr(sensitivity, "_layers_recomputed", lambda body, cache: contextlib.nullcontext())
    whole = sensitivity.fisher_diagonals(smollm2, **SHORT)
    assert all(torch.equal(a, b) for a, b in zip(whole.keys + whole.values, recomputed.keys + recomputed.values))
    monkeypatch.undo()
    kept, every = _saved_bytes(smollm2, True), _saved_bytes(smollm2, False)
    assert every > 20 * kept, (kept, every)
