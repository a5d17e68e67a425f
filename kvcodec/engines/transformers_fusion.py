"""Segment fusion in transformers (the model-generic half is :mod:`kvcodec.blend.fusion`): a segment's KV computed
with the model, and the selective recompute run through the model's own decoder layers, attention and rotary code.

:func:`recompute` drives the decoder layers itself (embedding, rotary embedding, then each layer) over only the
tokens a :class:`~kvcodec.blend.fusion.RecomputeSchedule` selects, at their positions in the prompt: the anchor,
then each segment through every layer as soon as :class:`~kvcodec.blend.fusion.SegmentLoads` has it in, while the
later ones load.  The cache is a transformers ``DynamicCache`` whose layers (:class:`FusedLayer`) hold the whole
fused context and, when the attention writes the selected tokens' new keys and values, scatter them at those
tokens' positions, measure how far they moved (what narrows a segment's selection for its next layers) and hand
the attention the context up to the last selected token.  The anchor takes the model's causal prefill path,
without a mask; a segment's tokens are computed in a few blocks of consecutive positions, each with a mask that
lets a token attend to the context up to its own position.  After it, the same cache grows as any
``DynamicCache`` does, so the suffix runs through the model's ordinary forward.

Supported: decoders whose every layer attends to the whole context with RoPE (Llama's architecture, which
SmolLM2 has).  Sliding-window layers (Gemma 3) would need the window applied to the selected tokens' mask and
segments longer than a window kept whole; they are refused, not computed wrongly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvcodec.blend.fusion import (FusionReport, RecomputeSchedule, SegmentLoads, ShareChoice, controlled_share,
                                  deviation, segment_shares, token_changes)
from kvcodec.blend.segments import SegmentStore
from kvcodec.cache import KVCache
from kvcodec.errors import InvalidInputError, UnsupportedError
from kvcodec.positions import Rotary
from kvcodec.store.chunks import ChunkShape

# Model types whose decoder layers this driver has been checked against (a fusion at share 1 equals a full
# prefill: tests/test_fusion.py).
SUPPORTED_MODEL_TYPES = ("llama",)


def check_supported(model: Any) -> None:
    """Raise :class:`UnsupportedError` for a model :func:`recompute` cannot run correctly."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedError(f"segment fusion runs on {', '.join(SUPPORTED_MODEL_TYPES)} models (every layer full "
                               f"attention with RoPE); this is a {kind!r} model")
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])) or \
            getattr(config, "sliding_window", None):
        raise UnsupportedError("segment fusion does not handle sliding-window layers yet")


def model_rotary(model: Any) -> list[Rotary]:
    """The rotary setting of each of ``model``'s layers, read from its rotary embedding (one for every layer: the
    supported models have one kind of layer)."""
    emb = model.model.rotary_emb
    rotary = Rotary(emb.inv_freq.detach().double().cpu().numpy(), float(getattr(emb, "attention_scaling", 1.0)))
    return [rotary] * model.config.num_hidden_layers


@torch.no_grad()
def segment_kv(model: Any, anchor: Sequence[int], token_ids: Sequence[int], *, model_id: str | None = None,
               dtype: torch.dtype | None = None) -> KVCache:
    """The KV of segment ``token_ids`` computed after ``anchor`` (the anchor's own tokens left out), keys after
    RoPE at positions ``len(anchor) ..``, in ``dtype`` (None: the model's)."""
    from transformers import DynamicCache

    ids = [int(t) for t in anchor] + [int(t) for t in token_ids]
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ids], device=model.device), cache=cache, use_cache=True)
    a = len(anchor)
    layers = [(l.keys[0, :, a:], l.values[0, :, a:]) for l in cache.layers]
    kv = KVCache(layers, model=model_id, rope="post", positions=range(a, len(ids)))
    return kv if dtype is None else kv.to(dtype=dtype)


class _Selection:
    """What the driver and the cache layers share: the tokens the current call computes (None: no fusion is
    running, the layers grow as usual), whether they are the context's first tokens (written as a slice), the
    context the attention reads (positions below ``end``), whether to measure their deviation, and the last one
    measured."""

    def __init__(self) -> None:
        self.selected: torch.Tensor | None = None
        self.prefix = False
        self.end = 0
        self.measure = False
        self.deviation: torch.Tensor | None = None


def _fused_layer_class():
    from transformers.cache_utils import DynamicLayer

    class FusedLayer(DynamicLayer):
        """A layer holding a fused context ``[1, H, N, D]``; while a fusion runs, the keys and values the attention
        writes belong to the selected tokens and replace theirs in place, and the attention reads the context up
        to the last of them."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, selection: _Selection) -> None:
            super().__init__()
            self.keys, self.values, self.selection = keys, values, selection
            self.device, self.is_initialized = keys.device, True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            s = self.selection
            if s.selected is None:
                return super().update(key_states, value_states, *args, **kwargs)
            where = slice(0, s.end) if s.prefix else s.selected
            if s.measure:
                s.deviation = token_changes(self.keys[:, :, where], key_states, self.values[:, :, where],
                                            value_states)
            self.keys[:, :, where] = key_states.to(self.keys.dtype)
            self.values[:, :, where] = value_states.to(self.values.dtype)
            return self.keys[:, :, :s.end], self.values[:, :, :s.end]

    return FusedLayer


# Selected tokens are run through a layer in up to MAX_BLOCKS blocks of consecutive positions, each attending to
# the context up to its last token only: SDPA's CPU kernel with a mask computes the whole [queries, context]
# rectangle (it cannot skip the masked part as its causal path does), so in one block a selected token's attention
# costs about twice a causal prefill's.  Measured (SmolLM2, 3,831 tokens, 30% share, 1 thread): attention 3.9-4.0 s
# in one block, 2.9-3.1 s in 4, for the whole recompute 1.03x, 1.00x, 1.05x (8 blocks of at least 128) and 1.39x
# (16 of 64): past 4, each call's copies of the context (transformers repeats the KV heads when a mask is given) and
# its overhead outweigh the shorter rectangles.
MAX_BLOCKS = 4
MIN_BLOCK = 256


@dataclass
class _Block:
    """One call of a layer: the rows of the selection it computes, their positions, the context they read
    (``end``), their attention mask (None: they are the context's first tokens, the causal path) and rotary
    embedding (cos, sin)."""

    rows: slice
    selected: torch.Tensor
    end: int
    mask: torch.Tensor | None
    rotary: tuple[torch.Tensor, torch.Tensor]


def _blocks(inner: Any, hidden: torch.Tensor, sel: torch.Tensor) -> list[_Block]:
    """How a layer computes the selected tokens ``sel`` (ascending indices, on the model's device), whose hidden
    states are ``hidden``: built once per selection, as the selection changes at two layers only."""
    n = len(sel)
    end = int(sel[-1]) + 1
    pos = sel[None]
    cos, sin = inner.rotary_emb(hidden, position_ids=pos)
    if end == n:  # the first n tokens: a prefill's causal attention, which SDPA runs without a mask
        return [_Block(slice(0, n), sel, n, None, (cos, sin))]
    count = max(1, min(MAX_BLOCKS, n // MIN_BLOCK))
    cuts = [round(n * b / count) for b in range(count + 1)]
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        part = sel[a:b]
        e = int(part[-1]) + 1
        # each selected token attends to the context up to its own position; additive, as SDPA turns a boolean
        # mask into one at every call (2.7% of a 30% recompute's time, 3,831 tokens)
        allowed = torch.arange(e, device=sel.device)[None, :] <= part[:, None]
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=sel.device).masked_fill_(~allowed, -math.inf)
        mask = mask[None, None]
        out.append(_Block(slice(a, b), part, e, mask, (cos[:, a:b], sin[:, a:b])))
    return out


@dataclass
class Recomputed:
    """The fused context's cache after :func:`recompute` (a ``DynamicCache`` that grows as usual from here), the
    tokens each layer computed, the seconds it took (waits for loads included), the share used and why, and the
    seconds per token-layer of the first layers over the whole context when they computed every token (else
    None): the model's prefill speed at this length."""

    cache: Any
    counts: list[int]
    seconds: float
    share: ShareChoice
    token_layer_s: float | None = None


# Below this many tokens through the first layers, their time says more about the calls than about the tokens: the
# loading controller then takes the seconds per token-layer from the caller's prefill speed, where it has one.
MEASURE_TOKENS = 64


@torch.no_grad()
def recompute(model: Any, loads: SegmentLoads, schedule: RecomputeSchedule,
              prefill_tps: float | None = None) -> Recomputed:
    """Recompute the tokens ``schedule`` selects over the context ``loads`` fills (its tensors become the cache's,
    written in place): the anchor, then each segment as soon as it is in, each through every layer while the later
    ones load.  Attention is causal, so a segment's tokens see only the anchor and the segments before it, which
    are final by then: the result is what computing layer by layer over the whole context gives with the same
    selection.  Each segment's selection is its own: every token up to the check layer, then its share of its
    tokens by deviation, the schedule's share spread over the segments by position
    (:func:`~kvcodec.blend.fusion.segment_shares`).  A schedule without a share gets the loading controller's at each segment's check layer,
    from the loads still to come and the seconds per token-layer measured so far (``prefill_tps``, tokens/s, the
    caller's estimate, stands in until enough tokens are measured)."""
    from transformers import DynamicCache

    check_supported(model)
    t0 = time.perf_counter()
    inner, dev = model.model, model.device
    layers = model.config.num_hidden_layers
    selection = _Selection()
    cls = _fused_layer_class()
    cache = DynamicCache(config=model.config)
    cache.layers = [cls(k[None].to(dev), v[None].to(dev), selection) for k, v in loads.layers]
    ids = torch.tensor(loads.token_ids, device=dev)
    spans = [(0, len(loads.anchor))] + [(s, s + len(seg)) for s, seg in zip(loads.starts, loads.segments)]
    total_reusable = None
    counts, shares, reasons = [0] * layers, [], []
    measured_s = measured = 0.0  # the first layers' seconds and token-layers over whole segments
    for g, (a, b) in enumerate(spans):
        if g:
            loads.wait(g - 1)
        forced = loads.forced[a:b]
        reusable = int((~forced).sum())
        if reusable and total_reusable is None:
            total_reusable = int((~loads.forced).sum())  # (the later segments' misses are not known yet)
        local = schedule
        if reusable and schedule.share is not None:
            local = dataclasses.replace(schedule, share=segment_shares(schedule.share, spans[1:])[g - 1])
        sel = schedule.first(forced) + a
        whole = len(sel) == b - a
        t_layers = time.perf_counter()
        if len(sel):
            hidden = inner.embed_tokens(ids[sel][None])
            blocks = _blocks(inner, hidden, sel.to(dev))
        for i, layer in enumerate(inner.layers[:layers]):
            if not len(sel):
                break
            counts[i] += len(sel)
            selection.measure = bool(reusable) and local.measures(i)
            outs, devs = [], []
            for blk in blocks:
                selection.selected, selection.end, selection.prefix = blk.selected, blk.end, blk.mask is None
                outs.append(layer(hidden[:, blk.rows], attention_mask=blk.mask, position_ids=blk.selected[None],
                                  cache=cache, use_cache=True, position_embeddings=blk.rotary))
                devs.append(selection.deviation)
            hidden = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
            if i == schedule.check_layer and whole:
                measured_s += time.perf_counter() - t_layers
                measured += (b - a) * (i + 1)
            if reusable and i == schedule.check_layer and schedule.share is None:
                tls = measured_s / measured if measured else 0.0
                if measured < MEASURE_TOKENS * (i + 1) and prefill_tps:
                    tls = 1.0 / (prefill_tps * layers)
                left = total_reusable - sum(int((~loads.forced[x:y]).sum()) for x, y in spans[1:g])
                choice = controlled_share(loads.estimate_left_s(), layers, left, tls)
                local = dataclasses.replace(schedule, share=segment_shares(choice.share, spans[1:])[g - 1])
                reasons.append(choice.reason)
            if selection.measure:
                keep = local.narrow(i, sel - a, deviation(torch.cat(devs, 1)).cpu(), forced)
                if len(keep) < len(sel):
                    hidden, sel = hidden[:, keep.to(dev)], sel[keep]
                    blocks = _blocks(inner, hidden, sel.to(dev))
        if reusable:  # (a model no deeper than the check layer computed every token: share 1)
            shares.append((reusable, 1.0 if local.share is None else local.share))
    selection.selected = None
    each = ", ".join(f"{x:.0%}" for _, x in shares)
    if schedule.share is not None:
        choice = ShareChoice(schedule.share, "given" + (f" (per segment: {each})" if len(shares) > 1 else ""))
    elif shares:  # the share over the reused tokens, the first segment's reason, then each one's share
        mean = sum(n * x for n, x in shares) / sum(n for n, _ in shares)
        choice = ShareChoice(mean, reasons[0] + (f" (per segment: {each})" if len(shares) > 1 else ""))
    else:  # nothing reusable: every token was computed
        choice = ShareChoice(0.0, "nothing reused")
    token_layer_s = measured_s / measured if measured >= MEASURE_TOKENS * (schedule.check_layer + 1) else None
    return Recomputed(cache, counts, time.perf_counter() - t0, choice, token_layer_s)


@dataclass
class Fusion:
    """A fused prompt: its ``token_ids`` (anchor, segments, suffix), the model's ``logits`` ``[len(suffix), V]``
    over the suffix (the last row predicts the first new token), the ``cache`` of the whole prompt to continue
    from, the :class:`~kvcodec.blend.fusion.FusionReport`, and the seconds per token-layer the model took over the
    whole context at its first layers (None where they did not compute every token): its prefill speed here."""

    token_ids: list[int]
    logits: torch.Tensor
    cache: Any
    report: FusionReport
    token_layer_s: float | None = None


@torch.no_grad()
def fuse(model: Any, store: SegmentStore, segments: Sequence[Sequence[int]], suffix: Sequence[int], *,
         schedule: RecomputeSchedule, shape: ChunkShape, recompute_tps: float | None = None) -> Fusion:
    """The prompt ``anchor + segments + suffix``: the segments loaded from ``store`` and fused (forced tokens and
    those ``schedule`` picks recomputed), then ``suffix`` (at least one token) computed over them.
    ``recompute_tps`` (the model's prefill speed, tokens/s) stops a segment's load where computing its rest is
    sooner."""
    suffix = [int(t) for t in suffix]
    if not suffix:
        raise InvalidInputError("a fused prompt needs a suffix of at least one token (the question), whose logits "
                                "continue it")
    check_supported(model)
    t0 = time.perf_counter()
    loads = SegmentLoads(store, segments, shape, model_rotary(model), device=model.device, dtype=model.dtype,
                         recompute_tps=recompute_tps).start()
    done = recompute(model, loads, schedule, recompute_tps)
    context = loads.context()
    t1 = time.perf_counter()
    logits = model(torch.tensor([suffix], device=model.device), cache=done.cache, use_cache=True).logits[0]
    now = time.perf_counter()
    forced = int(context.forced.sum())
    report = FusionReport(context.num_tokens + len(suffix), context.num_tokens, context.num_tokens - forced, forced,
                          done.share.share, done.counts, context.segments, context.nbytes, context.load_s,
                          done.seconds, now - t1, now - t0, done.share.reason)
    return Fusion(context.token_ids + suffix, logits, done.cache, report, done.token_layer_s)
