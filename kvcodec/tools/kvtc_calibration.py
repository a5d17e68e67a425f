"""Computing kvtc calibrations: run a model over calibration text, weigh its keys and values, fit the PCA bases.

The design (features, weights, truncation) is described in :mod:`kvcodec.codecs.kvtc.calibration`, which holds
what a decoder needs of a calibration (the file, its lookup); this half runs models, so it is tooling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.codecs.kvtc.calibration import (Calibration, GroupBasis, LayerInfo, cache_dir, calibration_for_model,
                                             install, register_calibration)
from kvcodec.codecs.kvtc.levels import LEVELS
from kvcodec.codecs.kvtc.rope import Rotary
from kvcodec.errors import InvalidInputError
from kvcodec.tools.texts import load_text

# Calibration texts: every machine has them, and none is one of the default evaluation texts
# (kvcodec.tools.texts.DEFAULT_EVAL_TEXTS) or a version of one.
DEFAULT_CALIBRATION_TEXTS = ("license:GFDL-1.3", "license:LGPL-2.1", "license:Apache-2.0", "license:Artistic")
SEGMENT_TOKENS = 2048
SINK_TOKENS = 1  # left out of the statistics: kvtc stores them exactly
# A component whose std is below this fraction of the finest step rounds to zero at every level
# (|c| >= step/2 needs a 3.3-sigma excursion), so the basis drops it.
TRUNCATE_FRACTION = 0.15
WEIGHT_FLOOR = 1e-3


def model_layers(model: Any) -> list[LayerInfo]:
    """Heads, head sizes and rotary settings of a transformers decoder's attention layers.  A model whose layer
    types use different rotary settings (Gemma 3: sliding layers at theta 1e4, full layers at 1e6) keeps them on its
    rotary embedding as ``{layer_type}_inv_freq`` and ``{layer_type}_attention_scaling`` (transformers 5)."""
    cfg = model.config
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // nq
    emb = getattr(model.model, "rotary_emb", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    rope = getattr(cfg, "position_embedding_type", "rope") in ("rope", None)
    out = []
    for i in range(cfg.num_hidden_layers):
        prefix = f"{layer_types[i]}_" if i < len(layer_types) and hasattr(emb, f"{layer_types[i]}_inv_freq") else ""
        inv_freq = getattr(emb, prefix + "inv_freq", None)
        rot = None
        if rope and inv_freq is not None:
            rot = Rotary(inv_freq.detach().double().cpu().numpy(), float(getattr(emb, prefix + "attention_scaling", 1.0)))
        out.append(LayerInfo(nkv, d, d, rot))
    return out


def default_groups(layers: Sequence[LayerInfo], group_layers: int | None, window_layers: Sequence[bool] = ()) -> list[list[int]]:
    """The layers of each kind (shape, rotary, sliding window or not) in order, at most ``group_layers`` per group
    (None: as many as there are)."""
    def kind(i: int) -> tuple:
        l = layers[i]
        return (l.heads, l.key_dim, l.value_dim, None if l.rotary is None else l.rotary.inv_freq.tobytes(),
                window_layers[i] if i < len(window_layers) else False)

    kinds: dict[tuple, list[int]] = {}
    for i in range(len(layers)):
        kinds.setdefault(kind(i), []).append(i)
    size = group_layers or len(layers)
    groups = [members[j:j + size] for members in kinds.values() for j in range(0, len(members), size)]
    return sorted(groups)


@dataclass
class Features:
    """What a model run over calibration text yields, before any grouping: per layer the feature rows of the
    keys (rotary embedding undone) and values ``[N, H * D]``, and the channel weights ``[H * D]``."""

    model: str
    layers: list[LayerInfo]
    windowed: list[bool]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_weights: list[torch.Tensor]
    value_weights: list[torch.Tensor]
    settings: dict[str, Any]


class _AttentionTaps:
    """Forward hooks on each decoder block that record what the channel weights need:

    * the queries as the attention multiplies them with the keys: the query projection's output, through the
      attention's own query norm when it has one (``q_norm``: Gemma 3, Qwen 3), ``[T, heads * dim]``;
    * the gain per hidden channel of whatever the block applies to the attention's output before adding it to the
      residual stream (Gemma's post-attention RMSNorm divides it by its RMS and multiplies by a learned weight):
      the least-squares slope of that module's output on its input, per channel (1 where the output is added as
      it is, as in Llama).  It is found as the child module whose input is the attention's output tensor itself.
    """

    def __init__(self, blocks: Any, heads: int) -> None:
        self.queries: dict[int, torch.Tensor] = {}
        self._cross: dict[int, torch.Tensor] = {}  # sum over tokens of output * input, per hidden channel
        self._square: dict[int, torch.Tensor] = {}  # sum over tokens of input ** 2
        self._attn_out: dict[int, torch.Tensor] = {}
        self._hooks = []
        for idx, block in enumerate(blocks):
            attn = block.self_attn
            norm = getattr(attn, "q_norm", None)

            def on_query(m: Any, i: Any, o: torch.Tensor, idx: int = idx, norm: Any = norm) -> None:
                q = o[0].detach()
                if norm is not None:
                    q = norm(q.reshape(q.shape[0], heads, -1))
                self.queries[idx] = q.reshape(q.shape[0], -1).float()

            def on_attention(m: Any, i: Any, o: Any, idx: int = idx) -> None:
                self._attn_out[idx] = o[0] if isinstance(o, tuple) else o

            def on_child(m: Any, i: Any, o: Any, idx: int = idx) -> None:
                if i and i[0] is self._attn_out.get(idx) and isinstance(o, torch.Tensor) and o.shape == i[0].shape:
                    x, y = i[0].detach().double().reshape(-1, o.shape[-1]), o.detach().double().reshape(-1, o.shape[-1])
                    self._cross[idx] = self._cross.get(idx, 0) + (x * y).sum(0)
                    self._square[idx] = self._square.get(idx, 0) + x.pow(2).sum(0)

            self._hooks.append(attn.q_proj.register_forward_hook(on_query))
            self._hooks.append(attn.register_forward_hook(on_attention))
            self._hooks += [child.register_forward_hook(on_child) for child in block.children() if child is not attn]

    def output_gain(self, idx: int) -> torch.Tensor:
        """Per hidden channel, how much of a change in the attention's output reaches the residual stream."""
        if idx not in self._cross:
            return torch.ones(1, dtype=torch.float64)
        return self._cross[idx] / self._square[idx].clamp_min(1e-30)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@torch.no_grad()
def collect_features(loaded: Any, texts: Sequence[str] = DEFAULT_CALIBRATION_TEXTS, *,
                     segment_tokens: int = SEGMENT_TOKENS, max_tokens: int | None = None, undo_rope: bool = True,
                     progress: Any = None) -> Features:
    """Run ``loaded`` (a :class:`kvcodec.tools.models.LoadedModel`) over ``texts`` (specs for
    :func:`kvcodec.tools.texts.load_text`) in segments of ``segment_tokens`` and gather the calibration features."""
    from transformers import DynamicCache


    model = loaded.model
    cfg = model.config
    layers = model_layers(model)
    if not undo_rope:
        layers = [LayerInfo(l.heads, l.key_dim, l.value_dim, None) for l in layers]
    layer_types = getattr(cfg, "layer_types", None) or []
    windowed = [t == "sliding_attention" for t in layer_types]
    nq = cfg.num_attention_heads
    blocks = model.model.layers
    if not all(hasattr(b, "self_attn") and hasattr(b.self_attn, "q_proj") and hasattr(b.self_attn, "o_proj") for b in blocks):
        raise InvalidInputError("kvtc calibration needs attention layers with q_proj and o_proj (Llama, Qwen, Gemma, ...)")
    segments = []
    for spec in texts:
        ids = loaded.tokenize(load_text(spec))
        segments += [ids[i:i + segment_tokens] for i in range(0, len(ids), segment_tokens)
                     if len(ids) - i >= segment_tokens // 4]
    if max_tokens is not None:
        while len(segments) > 1 and sum(map(len, segments)) > max_tokens:
            segments.pop()
    if not segments:
        raise InvalidInputError("the calibration texts are too short")
    q_energy = [torch.zeros(l.heads, l.key_dim, dtype=torch.float64) for l in layers]
    resid_sq = torch.zeros(len(layers), dtype=torch.float64)
    counted = 0
    keys_pre: list[list[torch.Tensor]] = [[] for _ in layers]
    values: list[list[torch.Tensor]] = [[] for _ in layers]
    taps = _AttentionTaps(blocks, nq)
    try:
        for seg in (progress(segments, len(segments)) if progress else segments):
            # A cache without the model's config keeps every token of every layer (a sliding-window layer's own
            # cache keeps only its window): the keys and values do not depend on it, and windowed layers then
            # give as many feature rows as the others.
            cache = DynamicCache()
            out = model(torch.tensor([seg]), use_cache=True, output_hidden_states=True, **loaded._cache_arg(cache))
            kv = KVCache.from_hf(cache)
            n = len(seg)
            for i, l in enumerate(layers):
                qd = taps.queries[i][SINK_TOKENS:].double().pow(2).sum(0)
                q_energy[i] += qd.reshape(l.heads, nq // l.heads, l.key_dim).sum(1)
                resid_sq[i] += out.hidden_states[i][0, SINK_TOKENS:].double().pow(2).mean(-1).sum()
                k, v = kv.layers[i].keys.float(), kv.layers[i].values.float()
                t = k.shape[1]
                pos = torch.arange(n - t, n)
                if l.rotary is not None:
                    k = l.rotary.rotate(k, pos, inverse=True)
                keep = pos >= SINK_TOKENS
                keys_pre[i].append(k[:, keep].permute(1, 0, 2).reshape(int(keep.sum()), -1))
                values[i].append(v[:, keep].permute(1, 0, 2).reshape(int(keep.sum()), -1))
            counted += n - SINK_TOKENS
    finally:
        taps.remove()
    key_weights, value_weights = [], []
    for i, l in enumerate(layers):
        energy = q_energy[i] / counted
        half = l.rotary.dims // 2 if l.rotary is not None else 0
        if half:  # RoPE rotates energy within a pair: weight the pair by its mean
            pair = (energy[:, :half] + energy[:, half:2 * half]) / 2
            energy = torch.cat([pair, pair, energy[:, 2 * half:]], -1)
        scaling = float(getattr(blocks[i].self_attn, "scaling", l.key_dim ** -0.5))  # the logits' factor
        key_weights.append(_floored((energy.sqrt() * scaling).reshape(-1)))
        wo = blocks[i].self_attn.o_proj.weight.double() * taps.output_gain(i)[:, None]
        col = wo.pow(2).sum(0).reshape(l.heads, nq // l.heads, l.value_dim).sum(1).sqrt()
        value_weights.append(_floored((col / math.sqrt(resid_sq[i] / counted)).reshape(-1)))
    settings = {"texts": list(texts), "segment_tokens": segment_tokens, "tokens": counted, "undo_rope": undo_rope,
                "window": getattr(cfg, "sliding_window", None)}
    return Features(loaded.model_id, layers, windowed, [torch.cat(f) for f in keys_pre], [torch.cat(f) for f in values],
                    key_weights, value_weights, settings)


def _floored(weight: torch.Tensor) -> torch.Tensor:
    """Weights of at least ``WEIGHT_FLOOR`` times the layer's largest: a channel nothing reads (Gemma 3 270M's
    query norm zeroes some query channels, so their keys' weight is 0) must still be invertible; its error then
    costs next to nothing, as it should."""
    return weight.clamp_min(WEIGHT_FLOOR * float(weight.max()))


def calibrate(loaded: Any, texts: Sequence[str] = DEFAULT_CALIBRATION_TEXTS, *, group_layers: int | None = None,
              finest_steps: tuple[float, float] | None = None, segment_tokens: int = SEGMENT_TOKENS,
              max_tokens: int | None = None, undo_rope: bool = True, weight_keys: bool = True,
              weight_values: bool = True, progress: Any = None, features: Features | None = None) -> Calibration:
    """Compute a calibration of ``loaded`` from ``texts`` (see :func:`collect_features`, or pass ``features``
    already collected).

    ``group_layers`` pools that many consecutive layers per basis (None: all layers of a kind).  ``undo_rope``,
    ``weight_keys`` and ``weight_values`` switch off the design's parts, for measuring what each is worth.
    """
    f = features or collect_features(loaded, texts, segment_tokens=segment_tokens, max_tokens=max_tokens,
                                     undo_rope=undo_rope, progress=progress)
    groups = default_groups(f.layers, group_layers, f.windowed)
    key_weights = f.key_weights if weight_keys else _flat(f.key_weights, groups)  # one weight per group
    value_weights = f.value_weights if weight_values else _flat(f.value_weights, groups)
    settings = f.settings | {"group_layers": group_layers, "weight_keys": weight_keys, "weight_values": weight_values}
    return fit_calibration(f.model, f.layers, groups, f.keys, f.values, key_weights, value_weights, finest_steps,
                           settings)


def _flat(weights: list[torch.Tensor], groups: list[list[int]]) -> list[torch.Tensor]:
    out = list(weights)
    for members in groups:
        rms = float(torch.cat([weights[i] for i in members]).pow(2).mean().sqrt())
        for i in members:
            out[i] = torch.full_like(weights[i], rms)
    return out


def fit_calibration(model: str, layers: list[LayerInfo], groups: list[list[int]], keys_pre: list[torch.Tensor],
                    values: list[torch.Tensor], key_weights: list[torch.Tensor], value_weights: list[torch.Tensor],
                    finest_steps: tuple[float, float] | None = None, settings: dict[str, Any] | None = None) -> Calibration:
    """The PCA bases of each group from per-layer feature rows ``[N, H * D]`` (keys already rotated back to
    position 0) and per-layer channel weights ``[H * D]``."""
    if finest_steps is None:
        finest_steps = (min(k for k, _ in LEVELS.values()), min(v for _, v in LEVELS.values()))
    kb, vb = [], []
    for members in groups:
        for feats, weights, bases, finest in ((keys_pre, key_weights, kb, finest_steps[0]),
                                              (values, value_weights, vb, finest_steps[1])):
            w = torch.cat([weights[i].reshape(-1) for i in members]).double()
            x = torch.cat([feats[i] for i in members], 1).double()
            bases.append(_basis(x, w, TRUNCATE_FRACTION * finest))
    return Calibration(model, layers, groups, kb, vb, settings or {})


def _basis(x: torch.Tensor, w: torch.Tensor, min_std: float) -> GroupBasis:
    """PCA of the weighted rows of ``x`` ``[N, F]`` (float64), components with std >= ``min_std``."""
    mean = x.mean(0)
    xw = (x - mean) * w
    cov = (xw.T @ xw) / max(x.shape[0] - 1, 1)
    var, vec = torch.linalg.eigh(cov)
    var, vec = var.flip(0).clamp_min(0), vec.flip(1)
    # a deterministic sign: each component's largest entry positive
    sign = torch.sign(vec.gather(0, vec.abs().argmax(0, keepdim=True)))
    vec = vec * torch.where(sign == 0, 1.0, sign)
    keep = max(1, int((var.sqrt() >= min_std).sum()))
    return GroupBasis(mean.float(), w.float(), vec[:, :keep].half(), var[:keep].float())


def ensure_calibration(loaded: Any, log: Any = None, **options: Any) -> Calibration:
    """The calibration installed for ``loaded``'s model, or a new one computed now (with ``options`` for
    :func:`calibrate`), installed in the cache folder and announced through ``log`` (a callable taking a line):
    how tools and engine hooks that have the model get one on first use."""
    cal = calibration_for_model(loaded.model_id)
    if cal is not None:
        return register_calibration(cal)
    if log:
        log(f"kvtc: no calibration of {loaded.model_id} installed; calibrating it now (once) into {cache_dir()}")
    cal = calibrate(loaded, **options)
    path = install(cal)
    if log:
        log(f"kvtc: calibration {cal.digest} of {loaded.model_id} installed as {path}")
    return register_calibration(cal)
