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

The same measurement says what a step costs in all (:func:`predicted_kl`): the continuation's KL per token that
quantizing every component of a calibration's bases at a step should cause, from the components' variances, the
Fisher information along each (the diagonal's weighted sum) and a Gaussian's quantization error.  A calibration
uses it to give a level the same predicted loss on every model (:func:`level_kl_scale`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from kvcodec.errors import InvalidInputError
from kvcodec.texts import load_text

SENSITIVITY_TEXTS = ("license:GFDL-1.3",)  # a calibration text (never an evaluation one)
PREFIX_TOKENS = 1024
CONTINUATION_TOKENS = 512
SAMPLES = 2
CHANNEL_EXPONENT = 0.5  # how far equalized_weights moves each channel's weight towards its measured cost
CHANNEL_FLOOR = 1e-4  # a channel whose error costs nothing (a zeroed query channel) keeps a weight to invert
# The continuation's logits are computed this many tokens at a time, their gradient taken back to the last hidden
# state before the next: Gemma 3's 262k-token vocabulary makes a 512-token continuation's logits, softmax and
# their gradients about 2 GB in float32 at once (its calibration peaked at 4.9 GB with loss weights).
LOGIT_CHUNK = 64
GRADING_POINTS = 8  # ages at which a graded window's loss is averaged


@dataclass
class Sensitivity:
    """Per layer and channel (``[H * D]``, head-major), the Fisher information of a continuation's summed
    log-likelihood with respect to one cached key (or value) element, averaged over the layer's cached tokens
    (those the cache holds, less the sink): twice the expected loss rise per unit of noise variance added to that
    channel of every cached token, per token.  ``held``: those tokens per layer; ``continuation``: the tokens
    scored."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    held: list[int]
    continuation: int

    def costs(self, kind: str, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per layer and channel of ``kind`` (``"keys"`` or ``"values"``), the continuation's KL per token that a
        unit variance of weighted-domain error (channel weights ``weights``) on every cached token causes."""
        return [d * (n / 2 / self.continuation) / w.double().pow(2)
                for d, w, n in zip(getattr(self, kind), weights, self.held)]


def _logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits from its last hidden states, as its own forward makes them (Gemma 2's soft cap)."""
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def fisher_diagonals(loaded: Any, texts: Sequence[str] = SENSITIVITY_TEXTS, *, prefix_tokens: int = PREFIX_TOKENS,
                     continuation_tokens: int = CONTINUATION_TOKENS, samples: int = SAMPLES, sink_tokens: int = 1,
                     seed: int = 0, progress: Any = None) -> Sensitivity:
    """The :class:`Sensitivity` of ``loaded``'s cache of ``prefix_tokens`` of each text continued by the next
    ``continuation_tokens``, from ``samples`` draws of labels per text (``progress``: wraps an iterable and its
    length, as :func:`kvcodec.codecs.kvtc.fit.collect_statistics` takes it, counting the draws).  Memory: the model, its activations over
    the continuation for the backward pass, and :data:`LOGIT_CHUNK` tokens' logits."""
    model = loaded.model
    body = model.model  # the decoder stack; its last hidden states are taken to logits a chunk at a time
    with _frozen(model):
        return _fisher(loaded, body, texts, prefix_tokens, continuation_tokens, samples, sink_tokens, seed, progress)


@contextlib.contextmanager
def _frozen(model: Any) -> Iterator[None]:
    """The model's parameters need no gradient meanwhile: the forward pass then keeps only what the cache's
    gradient needs (a parameter's gradient would keep every layer's input, and the tied embedding's alone is
    Gemma 3's 262k x 640 floats)."""
    needs = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in needs:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, was in needs:
            p.requires_grad_(was)


def _fisher(loaded: Any, body: Any, texts: Sequence[str], prefix_tokens: int, continuation_tokens: int, samples: int,
            sink_tokens: int, seed: int, progress: Any) -> Sensitivity:
    model = loaded.model
    sums: list[list[torch.Tensor]] = [[], []]
    held: list[int] = []
    gen = torch.Generator().manual_seed(seed)
    draws = iter(progress(range(len(texts) * samples), len(texts) * samples) if progress else ())
    for spec in texts:
        ids = loaded.tokenize(load_text(spec))
        if len(ids) < prefix_tokens + continuation_tokens:
            raise InvalidInputError(f"sensitivity text {spec!r} has {len(ids)} tokens; "
                                    f"{prefix_tokens + continuation_tokens} are needed")
        with torch.no_grad():
            kv = loaded.prefill(ids[:prefix_tokens], dtype=torch.float16).to(dtype=loaded.dtype)
        cont = torch.tensor([ids[prefix_tokens:prefix_tokens + continuation_tokens]])
        kept = [l.keys.shape[1] for l in kv.layers]
        first = [max(0, sink_tokens - (kv.num_tokens - t)) for t in kept]  # the sink, where a layer holds it
        held = [t - f for t, f in zip(kept, first)]
        for _ in range(samples):
            next(draws, None)
            leaves = [(l.keys.detach().clone().requires_grad_(), l.values.detach().clone().requires_grad_())
                      for l in kv.layers]
            cache = type(kv)(leaves, model=kv.model, token_ids=kv.token_ids, rope=kv.rope).to_hf(model.config)
            with _layers_recomputed(body, cache):  # (through the backward pass, which runs each layer again)
                hidden = body(cont, use_cache=True, **loaded._cache_arg(cache)).last_hidden_state[0]
                top = hidden.detach().requires_grad_()
                back = torch.zeros_like(top)  # the log-likelihood's gradient at the last hidden states
                for a in range(0, top.shape[0], LOGIT_CHUNK):
                    logits = _logits(model, top[a:a + LOGIT_CHUNK])
                    with torch.no_grad():
                        drawn = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
                    back += torch.autograd.grad(torch.log_softmax(logits, -1).gather(1, drawn).sum(), top)[0]
                    del logits
                grads = torch.autograd.grad(hidden, [t for pair in leaves for t in pair], grad_outputs=back)
            del hidden, top, back, cache
            for i, f in enumerate(first):
                for kind in (0, 1):
                    sq = grads[2 * i + kind][:, f:].double().pow(2).sum(1).reshape(-1)  # [H * D]
                    if len(sums[kind]) <= i:
                        sums[kind].append(torch.zeros_like(sq))
                    sums[kind][i] += sq
            del grads, leaves
    next(draws, None)  # the last draw is done: the bar completes
    n = samples * len(texts)
    return Sensitivity([s / (t * n) for s, t in zip(sums[0], held)], [s / (t * n) for s, t in zip(sums[1], held)],
                       held, continuation_tokens)


@contextlib.contextmanager
def _layers_recomputed(body: Any, cache: Any) -> Iterator[None]:
    """Meanwhile each decoder layer of ``body`` keeps only its input for the backward pass and runs its forward
    again there (activation checkpointing), and ``cache`` hands every call the stored keys and values with the new
    ones after them without keeping the new ones, so that the second run sees what the first saw.  The
    continuation's activations were the loss measurement's peak: on a model of Qwen2.5-0.5B's shape (24 layers,
    4,864-wide MLPs, 14 query heads over 2 KV heads) about 1.3 GB over 512 tokens, against one layer's now; the
    price is a second forward pass over the continuation.  The gradients are the same: each layer computes the same
    values twice."""
    from torch.utils.checkpoint import checkpoint

    stored = [(layer.keys, layer.values) for layer in cache.layers]

    def update(keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        old_keys, old_values = stored[layer_idx]
        return torch.cat([old_keys, keys], dim=-2), torch.cat([old_values, values], dim=-2)

    own = [layer.__dict__.get("forward") for layer in body.layers]  # a forward set on the instance (a hook's)
    cache.update = update
    for layer in body.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer, forward in zip(body.layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
        del cache.update


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
                      sensitivity: Sensitivity | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``key_weights`` and ``value_weights`` (per layer ``[H * D]``) with each channel's moved ``channels`` of the
    way towards its measured cost (:func:`channel_factors`; ``layers``: the calibration's layer infos, whose rotary
    pairs keys keep together), then each layer's scaled by :func:`equalizing_scales` of its :func:`layer_traces`
    (keys and values each where asked), from ``sensitivity`` (default: measured now on ``texts``).

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
    sens = sensitivity or fisher_diagonals(loaded, texts)
    out = []
    for weights, diagonals, on, infos in ((key_weights, sens.keys, keys, layers), (value_weights, sens.values, values, None)):
        if not on:
            out.append(list(weights))
            continue
        if channels:
            weights = [(w.double() * channel_factors(d, w, channels, infos[i] if infos else None)).float()
                       for i, (w, d) in enumerate(zip(weights, diagonals))]
        scales = equalizing_scales(layer_traces(diagonals, weights))
        out.append([w * float(c) for w, c in zip(weights, scales)])
    return out[0], out[1]


# --- the loss a step costs -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _rounding_table() -> tuple[np.ndarray, np.ndarray]:
    """log std (in steps) and log mean squared error (in steps²) of a Gaussian rounded to the nearest step."""
    r = np.logspace(-2, 1, 121)  # past 10 steps the error is a uniform one's, 1/12, to 1e-6
    z = np.linspace(-8.0, 8.0, 32001)  # 1/2000 of a std: 200 points a step at the widest std
    p = np.exp(-z * z / 2)
    p /= p.sum()
    mse = np.array([((z * x - np.round(z * x)) ** 2 * p).sum() for x in r])
    return np.log(r), np.log(mse)


def rounding_error(std_over_step: np.ndarray, min_std: float) -> np.ndarray:
    """Per component whose coefficients are Gaussian with that std (in steps): the mean squared error, in steps²,
    of kvtc's quantization: rounding to the nearest step, or its whole variance where the component is not coded
    (std under ``min_std`` steps)."""
    r = np.asarray(std_over_step, dtype=np.float64)
    lr, lm = _rounding_table()
    out = np.exp(np.interp(np.log(np.maximum(r, 1e-300)), lr, lm))
    out = np.where(r >= np.exp(lr[-1]), 1 / 12, out)
    return np.where((r <= np.exp(lr[0])) | (r < min_std), r * r, out)


@dataclass
class PartLoss:
    """What a basis's (keys' or values' of one group) quantization costs the model: per component its variance
    and the continuation's KL per token per unit of its variance (the per-channel costs weighted by the
    component's squared loadings: the Fisher's diagonal along it), and ``rest``, the KL of the variance left out
    of the basis (never coded at any step)."""

    variance: np.ndarray
    cost: np.ndarray
    rest: float
    octaves: float = 0.0  # window grading: the step grows this many octaves from a window's newest token to its oldest

    @classmethod
    def of(cls, cov: torch.Tensor, variance: torch.Tensor, vectors: torch.Tensor, costs: torch.Tensor,
           octaves: float = 0.0) -> PartLoss:
        """From a weighted covariance ``[F, F]``, its kept eigenpairs, the per-feature costs ``[F]`` and the
        window grading its layers get (0: none)."""
        c = costs.double()
        along = torch.cat([vectors[:, a:a + 512].pow(2).T @ c for a in range(0, vectors.shape[1], 512)])
        rest = float(cov.diagonal() @ c - variance.double() @ along)
        return cls(variance.double().numpy(), along.numpy(), max(rest, 0.0), octaves)

    def kl(self, step: float, min_std: float) -> float:
        std = np.sqrt(np.maximum(self.variance, 0.0))
        # a graded window's tokens at GRADING_POINTS ages, each at its own step (the Fisher is a mean over tokens)
        ages = (np.arange(GRADING_POINTS) + 0.5) / GRADING_POINTS if self.octaves else np.zeros(1)
        return float(np.mean([self.cost @ (rounding_error(std / h, min_std) * h * h)
                              for h in step * 2.0 ** (self.octaves * ages)])) + self.rest


def predicted_kl(parts: Sequence[tuple[PartLoss, float]], min_std: float, scale: float = 1.0) -> float:
    """The continuation's KL per token predicted for coding every ``(part, step)`` at ``step / scale`` (weights
    ``scale`` times larger): second-order in the error, each component's error independent."""
    return sum(p.kl(step / scale, min_std) for p, step in parts)


def level_kl_scale(parts: Sequence[tuple[PartLoss, float]], target: float, min_std: float,
                bounds: tuple[float, float]) -> float:
    """The factor on every weight (within ``bounds``) that makes :func:`predicted_kl` of ``parts`` (at the default
    level's steps) ``target``; the nearest bound where that is out of reach."""
    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    if predicted_kl(parts, min_std, bounds[1]) >= target:
        return bounds[1]
    if predicted_kl(parts, min_std, bounds[0]) <= target:
        return bounds[0]
    for _ in range(40):  # the KL falls as the scale grows (the steps shrink)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_kl(parts, min_std, math.exp(mid)) > target else (lo, mid)
    return math.exp((lo + hi) / 2)
