"""Segment fusion in transformers (the model-generic half is :mod:`kvcodec.blend.fusion`): a segment's KV computed
with the model, and the selective recompute run through the model's own decoder layers, attention and rotary code.

:func:`fuse` has :func:`kvcodec.blend.fusion.recompute` drive the decoder layers (embedding, rotary embedding, then
each layer) over only the tokens a :class:`~kvcodec.blend.fusion.RecomputeSchedule` selects, at their positions in
the prompt: the anchor, then each segment through every layer as soon as :class:`~kvcodec.blend.fusion.SegmentLoads`
has it in, while the later ones load. The cache is a transformers ``DynamicCache`` whose layers
(:class:`FusedLayer`) hold the whole fused context and, when the attention writes the selected tokens' new keys and
values, scatter them at those tokens' positions, measure how far they moved (what narrows a segment's selection for
its next layers) and hand the attention the context up to the last selected token. The anchor takes the model's
causal prefill path, without a mask; a segment's tokens are computed in a few blocks of consecutive positions, each
with a mask that lets a token attend to the context up to its own position. After it, the same cache grows as any
``DynamicCache`` does, so the suffix runs through the model's ordinary forward.

Supported: decoders whose layers attend to the whole context or to a sliding window of it, with RoPE: Llama's
architecture (SmolLM2) and Gemma 3's (five sliding-window layers to one global, a rotary setting per kind).  A
sliding-window layer's selected tokens see the window in their masks, and its cache holds the whole context as a
full layer's does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvcodec.blend.fusion import FusionReport, RecomputeSchedule, SegmentLoads, query_blocks, recompute, token_changes
from kvcodec.blend.segments import SegmentStore
from kvcodec.cache import KVCache
from kvcodec.errors import InvalidInputError, UnsupportedError
from kvcodec.positions import Rotary
from kvcodec.store.chunks import ChunkShape

# Model types whose decoder layers this driver has been checked against (a fusion at share 1 equals a full
# prefill: tests/test_fusion.py, tests/test_gemma.py).
SUPPORTED_MODEL_TYPES = ("llama", "gemma3_text")
# The kinds of layers it runs: full attention, and attention to the last ``config.sliding_window`` tokens.
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_supported(model: Any) -> None:
    """Raise :class:`UnsupportedError` for a model :func:`fuse` cannot run correctly."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedError(f"segment fusion runs on {', '.join(SUPPORTED_MODEL_TYPES)} models (full or "
                               f"sliding-window attention with RoPE); this is a {kind!r} model")
    types = set(getattr(config, "layer_types", None) or ())
    if types - set(LAYER_TYPES) or (getattr(config, "sliding_window", None) and not types):
        raise UnsupportedError(f"segment fusion runs layers of kinds {', '.join(LAYER_TYPES)} (a window only where "
                               f"config.layer_types says so), not {sorted(types) or 'a window on every layer'}")
    # the masks the driver builds carry what the model's attention would otherwise add
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedError("segment fusion does not handle attention logit soft-capping or bidirectional "
                               "attention")


def layer_types(config: Any) -> list[str]:
    """Each layer's kind (:data:`LAYER_TYPES`)."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def model_rotary(model: Any) -> list[Rotary]:
    """The rotary setting of each of ``model``'s layers, read from its rotary embedding (per kind of layer where
    it has one per kind, as Gemma 3's local and global layers)."""
    emb = model.model.rotary_emb
    out = []
    for kind in layer_types(model.config):
        inv = getattr(emb, f"{kind}_inv_freq", None)
        scaling = getattr(emb, f"{kind}_attention_scaling", None) if inv is not None else None
        if inv is None:
            inv, scaling = emb.inv_freq, getattr(emb, "attention_scaling", 1.0)
        out.append(Rotary(inv.detach().double().cpu().numpy(), float(1.0 if scaling is None else scaling)))
    return out


@torch.no_grad()
def segment_kv(model: Any, anchor: Sequence[int], token_ids: Sequence[int], *, model_id: str | None = None,
               dtype: torch.dtype | None = None) -> KVCache:
    """The KV of segment ``token_ids`` computed after ``anchor`` (the anchor's own tokens left out), keys after
    RoPE at positions ``len(anchor) ..``, in ``dtype`` (None: the model's)."""
    from transformers import DynamicCache

    ids = [int(t) for t in anchor] + [int(t) for t in token_ids]
    cache = DynamicCache()  # every layer kept whole: a sliding layer's cache of the model's config keeps its window
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


class _Runner:
    """The model's decoder layers over a selection of the fused context (a :class:`~kvcodec.blend.fusion.
    LayerRunner`): the cache's layers (:class:`FusedLayer`) hold the context and take the selected tokens' new
    keys and values where the attention writes them."""

    def __init__(self, model: Any, loads: SegmentLoads) -> None:
        from transformers import DynamicCache

        self.inner, dev = model.model, model.device
        self.selection = _Selection()
        cls = _fused_layer_class()
        # every layer holds the whole context, a sliding-window one too: the selected tokens sit anywhere in it,
        # and the model's masks for the suffix apply the window over the whole length
        self.cache = DynamicCache(config=model.config)
        self.cache.layers = [cls(k[None].to(dev), v[None].to(dev), self.selection) for k, v in loads.layers]
        self.ids = torch.tensor(loads.token_ids, device=dev)
        self.device = dev
        self.kinds = layer_types(model.config)
        window = getattr(model.config, "sliding_window", None)
        self.windows = {k: window if k == "sliding_attention" else None for k in set(self.kinds)}

    def start(self, selected: torch.Tensor) -> None:
        self.sel = selected.to(self.device)
        self.hidden = self.inner.embed_tokens(self.ids[self.sel][None])
        self._blocks()

    def _blocks(self) -> None:
        # built once per selection, as the selection changes at two layers only; one set per kind of layer
        emb, pos = self.inner.rotary_emb, self.sel[None]
        self.blocks = {}
        for kind, window in self.windows.items():
            cos, sin = emb(self.hidden, pos, kind) if hasattr(emb, "layer_types") else emb(self.hidden, pos)
            self.blocks[kind] = [(blk, (cos[:, blk.start:blk.stop], sin[:, blk.start:blk.stop]),
                                  None if blk.mask is None else blk.mask[None, None])
                                 for blk in query_blocks(self.sel, self.hidden.dtype, window)]

    def layer(self, index: int, measure: bool) -> torch.Tensor | None:
        s, layer = self.selection, self.inner.layers[index]
        s.measure = measure
        outs, changes = [], []
        first = int(self.sel[-1]) + 1 == len(self.sel)  # the context's first tokens: written as a slice
        for blk, rotary, mask in self.blocks[self.kinds[index]]:
            s.selected, s.end = self.sel[blk.start:blk.stop], blk.end
            s.prefix = first and blk.start == 0 and blk.stop == blk.end
            outs.append(layer(self.hidden[:, blk.start:blk.stop], attention_mask=mask,
                              position_ids=s.selected[None], cache=self.cache, use_cache=True,
                              position_embeddings=rotary))
            changes.append(s.deviation)
        s.selected = None  # outside the driver's calls the cache grows as any DynamicCache does
        self.hidden = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        return torch.cat(changes, 1) if measure else None

    def narrow(self, keep: torch.Tensor) -> None:
        keep = keep.to(self.device)
        self.hidden, self.sel = self.hidden[:, keep], self.sel[keep]
        self._blocks()


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
                         recompute_tps=recompute_tps, schedule=schedule).start()
    runner = _Runner(model, loads)
    done = recompute(runner, loads, schedule, model.config.num_hidden_layers, recompute_tps)
    context = loads.context()
    t1 = time.perf_counter()
    logits = model(torch.tensor([suffix], device=model.device), cache=runner.cache, use_cache=True).logits[0]
    now = time.perf_counter()
    report = FusionReport.of(context, done, suffix_tokens=len(suffix), suffix_s=now - t1, first_token_s=now - t0)
    return Fusion(context.token_ids + suffix, logits, runner.cache, report, done.token_layer_s)
