"""How much loss a unit of kvtc's weighted-domain error costs in each layer, measured with the model itself.

kvtc quantizes every layer of a K/V kind with one step in its weighted domain (see
:mod:`kvcodec.codecs.kvtc.calibration`), so its bits go where the channel weights say an error costs the most.
Those weights are read off the model's matrices (query energy, output projection, residual RMS); they do not see
what happens after the next layer, nor that a sliding-window layer's cache is read by fewer queries.  This module
measures the cost directly: the expected rise of the next tokens' negative log-likelihood when independent noise
of variance ``σ²`` is added to every weighted-domain element of one layer's cached keys (or values) is, to second
order, ``σ²/2`` times the trace of that block's Fisher information, and the Fisher's trace is estimated without
one pass per layer: with labels drawn from the model's own predictions, the squared gradient of their summed
log-likelihood is an unbiased estimate of it (the cross terms between tokens vanish in expectation), for every
layer at once.  So one forward and backward pass over a continuation per sample gives every layer's sensitivity.

The protocol is the evaluation's: the model continues a float16 cache of a prefix, the cache's own layout
(a windowed layer holds only its window), the first (sink) token left out as kvtc stores it exactly.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from kvcodec.errors import InvalidInputError
from kvcodec.texts import load_text

SENSITIVITY_TEXTS = ("license:GFDL-1.3",)  # a calibration text (never an evaluation one)
PREFIX_TOKENS = 1024
CONTINUATION_TOKENS = 512
SAMPLES = 2
CHANNEL_EXPONENT = 0.5  # how far equalized_weights moves each channel's weight towards its measured cost
CHANNEL_FLOOR = 1e-4  # a channel whose error costs nothing (a zeroed query channel) keeps a weight to invert


def fisher_diagonals(loaded: Any, texts: Sequence[str] = SENSITIVITY_TEXTS, *, prefix_tokens: int = PREFIX_TOKENS,
                     continuation_tokens: int = CONTINUATION_TOKENS, samples: int = SAMPLES, sink_tokens: int = 1,
                     seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer and channel (``[H * D]``, head-major), the Fisher information of the continuation's summed
    log-likelihood with respect to one cached key (or value) element, averaged over the layer's cached tokens
    (those the cache holds, less the sink): twice the expected loss rise per unit of noise variance added to that
    channel of every cached token, per token."""
    model = loaded.model
    sums: list[list[torch.Tensor]] = [[], []]
    tokens = None
    gen = torch.Generator().manual_seed(seed)
    for spec in texts:
        ids = loaded.tokenize(load_text(spec))
        if len(ids) < prefix_tokens + continuation_tokens:
            raise InvalidInputError(f"sensitivity text {spec!r} has {len(ids)} tokens; "
                                    f"{prefix_tokens + continuation_tokens} are needed")
        with torch.no_grad():
            kv = loaded.prefill(ids[:prefix_tokens], dtype=torch.float16).to(dtype=model.dtype)
        cont = torch.tensor([ids[prefix_tokens:prefix_tokens + continuation_tokens]])
        held = [l.keys.shape[1] for l in kv.layers]
        first = [max(0, sink_tokens - (kv.num_tokens - t)) for t in held]  # the sink, where a layer holds it
        for _ in range(samples):
            leaves = [(l.keys.detach().clone().requires_grad_(), l.values.detach().clone().requires_grad_())
                      for l in kv.layers]
            cache = type(kv)(leaves, model=kv.model, token_ids=kv.token_ids, rope=kv.rope).to_hf(model.config)
            logits = model(cont, use_cache=True, **loaded._cache_arg(cache)).logits[0].float()
            with torch.no_grad():
                drawn = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            loglik = torch.log_softmax(logits, -1).gather(1, drawn).sum()
            grads = torch.autograd.grad(loglik, [t for pair in leaves for t in pair])
            del logits, loglik, cache
            for i, (t, f) in enumerate(zip(held, first)):
                for kind in (0, 1):
                    g = grads[2 * i + kind][:, f:].double()
                    sq = g.pow(2).sum(1).reshape(-1)  # [H * D]
                    if len(sums[kind]) <= i:
                        sums[kind].append(torch.zeros_like(sq))
                    sums[kind][i] += sq
        tokens = [(t - f) * samples * len(texts) for t, f in zip(held, first)]
    return [s / n for s, n in zip(sums[0], tokens)], [s / n for s, n in zip(sums[1], tokens)]


def layer_traces(diagonals: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per layer, the mean Fisher information per weighted-domain element (channel ``c`` divided by its weight):
    the loss a unit of kvtc's error costs there.  Keys need no rotary embedding undone: kvtc's key weights are
    equal within a rotary pair, and the rotation keeps a pair's summed squared gradient."""
    return torch.stack([(d / w.double().pow(2)).mean() for d, w in zip(diagonals, weights)])


def equalizing_scales(traces: torch.Tensor) -> torch.Tensor:
    """Per layer, the factor on its weights that makes a unit weighted-domain error cost the same loss in every
    layer of a kind (the square root of its trace over their geometric mean: the kind's mean log weight, and so
    roughly its rate at a level, stays as it was)."""
    if not bool(torch.all(traces > 0)):
        raise InvalidInputError("a layer's cache has no effect on the loss: cannot equalize its weight")
    return (traces / math.exp(float(traces.log().mean()))).sqrt()


def channel_factors(diagonals: torch.Tensor, weights: torch.Tensor, exponent: float, layer: Any = None) -> torch.Tensor:
    """Per channel of one layer, the factor on its weight that moves it ``exponent`` of the way (in log) towards
    making a unit weighted-domain error cost the same loss in every channel: ``(cost / mean cost) **
    (exponent / 2)``.  With a ``layer`` (its :class:`~kvcodec.codecs.kvtc.calibration.LayerInfo`, for keys) a
    rotary pair's channels share their mean cost: kvtc weights keys with the rotation undone, which mixes a pair."""
    cost = diagonals / weights.double().pow(2)
    if layer is not None and layer.rotary is not None:
        half = layer.rotary.dims // 2
        heads = cost.reshape(layer.heads, layer.key_dim).clone()
        pair = (heads[:, :half] + heads[:, half:2 * half]) / 2
        heads[:, :half], heads[:, half:2 * half] = pair, pair
        cost = heads.reshape(-1)
    return (cost / cost.mean()).clamp_min(CHANNEL_FLOOR).pow(exponent / 2)


def equalized_weights(loaded: Any, key_weights: Sequence[torch.Tensor], value_weights: Sequence[torch.Tensor],
                      texts: Sequence[str] = SENSITIVITY_TEXTS, *, keys: bool = True, values: bool = True,
                      channels: float = CHANNEL_EXPONENT, layers: Sequence[Any] | None = None,
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``key_weights`` and ``value_weights`` (per layer ``[H * D]``) with each channel's moved ``channels`` of the
    way towards its measured cost (:func:`channel_factors`; ``layers``: the calibration's layer infos, whose rotary
    pairs keys keep together), then each layer's scaled by :func:`equalizing_scales` of its :func:`layer_traces`
    (keys and values each where asked).

    Half-way (``channels`` 0.5), since one text's per-channel Fisher is noisy and the matrices' weights already
    hold most of it: on Gemma 3 270M (``bits=1.0``, window graded by one octave, nine texts) KL 0.0128 without
    per-channel costs and 0.0107 half-way (the default calibration's); on three texts, grading two octaves, 0.0116,
    0.0110 half-way and 0.0111 all the way.

    Both by default.  Gemma 3 270M's key traces under the matrices' weights span 90x across its layers (0.00012 to
    0.011 per unit step); on its three evaluation texts (the six default calibration texts, level 4, fine rows)
    equalizing values alone gave 1.080 bits/element at +2.14% perplexity, KL 0.0173, and keys and values 1.124 bits
    at +1.23%, KL 0.0112 (at ``bits=1.0``: KL 0.0196 and 0.0135; docs/codecs/kvtc.md).  An earlier one-text
    measurement without fine rows had favoured values alone on perplexity
    (bench/studies/results/kvtc_loss_weights-gemma3-270m.md)."""
    kd, vd = fisher_diagonals(loaded, texts)
    out = []
    for weights, diagonals, on, infos in ((key_weights, kd, keys, layers), (value_weights, vd, values, None)):
        if not on:
            out.append(list(weights))
            continue
        if channels:
            weights = [(w.double() * channel_factors(d, w, channels, infos[i] if infos else None)).float()
                       for i, (w, d) in enumerate(zip(weights, diagonals))]
        scales = equalizing_scales(layer_traces(diagonals, weights))
        out.append([w * float(c) for w, c in zip(weights, scales)])
    return out[0], out[1]
