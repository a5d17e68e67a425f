"""Fitting kvtc calibrations: run a model over calibration text, weigh its keys and values, fit the PCA bases, and
install the result where encoders find it (an engine hook's first use of kvtc does this while serving).

The design (features, weights, truncation) is described in :mod:`kvcodec.codecs.kvtc.calibration`, which holds
what a decoder needs of a calibration (the file, its lookup).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.codecs.kvtc.calibration import (Calibration, GroupBasis, LayerInfo, cache_dir, calibration_for_model,
                                             install, register_calibration)
from kvcodec.codecs.kvtc.eigen import leading_eigenpairs
from kvcodec.codecs.kvtc.levels import DEFAULT_LEVEL, DEFAULT_MIN_STD, DEFAULT_WINDOW_OCTAVES, LEVEL_KL, LEVELS
from kvcodec.codecs.kvtc.moments import Moments
from kvcodec.positions import Rotary
from kvcodec.codecs.kvtc.sensitivity import (PartLoss, Sensitivity, equalized_weights, fisher_diagonals,
                                             level_kl_scale, predicted_kl)
from kvcodec.errors import InvalidInputError
from kvcodec.memory import return_freed_memory
from kvcodec.texts import DEFAULT_CALIBRATION_TEXTS, DEFAULT_TEXT_TOKENS, load_text

SEGMENT_TOKENS = 2048
SINK_TOKENS = 1  # left out of the statistics: kvtc stores them exactly
# The basis keeps the components the codec codes at its finest level with min_std 0.2 (a component with a smaller
# std is never coded then; the default, 0.23, codes fewer); a codec asking for a smaller min_std codes all the file
# holds.  Kept at 0.2 when the default moved to 0.23: the calibrations made before stay what new ones are.
TRUNCATE_FRACTION = 0.2
# The layer-grouping rule: the layers of a kind are split into the fewest groups of consecutive layers (of sizes
# differing by at most one) whose features are at most this wide.  A group's covariance is then at most 302 MB
# (float64) and a basis at most 6144² float16 values per K/V: Llama-3-8B (32 layers of 8 × 128) gets groups of
# 6, 6, 5, 5, 5, 5 layers and a calibration of at most 722 MB, 4.5% of its fp16 weights, with every component
# kept.  SmolLM2 (5,760 features) and Gemma 3 270M keep one basis per kind: measured on SmolLM2, splitting it in
# two groups of 15 layers (a 4096 limit) cost 11% more bits and missed the default level's targets
# (bench/studies/results/kvtc_grouping.md).
MAX_GROUP_FEATURES = 6144
WEIGHT_FLOOR = 1e-3
# How far (either way) a calibration may scale its weights to give the default level its loss (levels.LEVEL_KL).
MAX_LEVEL_SCALE = 4.0


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


def default_groups(layers: Sequence[LayerInfo], group_layers: int | None, window_layers: Sequence[bool] = (),
                   max_features: int = MAX_GROUP_FEATURES) -> list[list[int]]:
    """The layers of each kind (shape, rotary, sliding window or not) in order, at most ``group_layers`` per group;
    None: the fewest groups of consecutive layers, of sizes differing by at most one, whose key and value features
    are each at most ``max_features`` wide (all layers of a kind when they fit; one layer per group when a layer
    alone is wider)."""
    def kind(i: int) -> tuple:
        l = layers[i]
        return (l.heads, l.key_dim, l.value_dim, None if l.rotary is None else l.rotary.inv_freq.tobytes(),
                window_layers[i] if i < len(window_layers) else False)

    if group_layers is not None and (not isinstance(group_layers, int) or group_layers < 1):
        raise InvalidInputError(f"group_layers must be a positive integer or None, not {group_layers!r}")
    kinds: dict[tuple, list[int]] = {}
    for i in range(len(layers)):
        kinds.setdefault(kind(i), []).append(i)
    groups = []
    for members in kinds.values():
        if group_layers is not None:
            groups += [members[j:j + group_layers] for j in range(0, len(members), group_layers)]
            continue
        l = layers[members[0]]
        per_layer = l.heads * max(l.key_dim, l.value_dim)
        # the fewest groups; a layer wider than the limit on its own (a large model without grouped queries) is
        # its own group, the finest the format has
        n = -(-len(members) // max(1, max_features // per_layer))
        size, extra = divmod(len(members), n)
        starts = [j * size + min(j, extra) for j in range(n + 1)]
        groups += [members[a:b] for a, b in zip(starts, starts[1:])]
    return sorted(groups)


@dataclass
class Statistics:
    """What a model run over calibration text yields: per layer group the streamed moments of the keys' (rotary
    embedding undone) and the values' feature rows, and per layer the channel weights ``[H * D]``."""

    model: str
    layers: list[LayerInfo]
    windowed: list[bool]
    groups: list[list[int]]
    keys: list[Moments]
    values: list[Moments]
    key_weights: list[torch.Tensor]
    value_weights: list[torch.Tensor]
    settings: dict[str, Any]

    def regroup(self, groups: list[list[int]]) -> Statistics:
        """These statistics for other groups, each within one of these (a block of its moments)."""
        if groups == self.groups:
            return self
        where = {l: (g, j) for g, members in enumerate(self.groups) for j, l in enumerate(members)}
        keys, values = [], []
        for members in groups:
            owners = {where[l][0] for l in members}
            if len(owners) != 1:
                raise InvalidInputError(f"layers {members} were not collected in one group: collect the statistics "
                                        "with a coarser grouping")
            g = owners.pop()
            for kind, out in (("keys", keys), ("values", values)):
                dim = "key_dim" if kind == "keys" else "value_dim"
                offsets = [0]
                for l in self.groups[g]:
                    offsets.append(offsets[-1] + self.layers[l].heads * getattr(self.layers[l], dim))
                cols = [c for l in members for c in range(offsets[where[l][1]], offsets[where[l][1] + 1])]
                out.append(getattr(self, kind)[g].select(cols))
        return Statistics(self.model, self.layers, self.windowed, groups, keys, values, self.key_weights,
                          self.value_weights, self.settings)

    @classmethod
    def from_rows(cls, model: str, layers: list[LayerInfo], groups: list[list[int]], keys_pre: list[torch.Tensor],
                  values: list[torch.Tensor], key_weights: list[torch.Tensor], value_weights: list[torch.Tensor],
                  settings: dict[str, Any] | None = None) -> Statistics:
        """The statistics of per-layer feature rows ``[N, H * D]`` already in memory (keys rotated back)."""
        stats = cls(model, layers, [False] * len(layers), groups, [], [], key_weights, value_weights, settings or {})
        for members in groups:
            for rows, out in ((keys_pre, stats.keys), (values, stats.values)):
                m = Moments(sum(rows[i].shape[1] for i in members))
                m.add(torch.cat([rows[i] for i in members], 1))
                out.append(m)
        return stats


class _AttentionTaps:
    """Forward hooks on each decoder block that record what the channel weights need, per segment (its first
    ``SINK_TOKENS`` left out), as each block runs, so that no block's activations outlive it (a segment's queries
    and hidden states, held until its end, were 0.36 GB of a 0.5B model's 2,048 tokens):

    * the queries' energy per channel as the attention multiplies them with the keys: the squares, summed over the
      tokens, of the query projection's output, through the attention's own query norm when it has one
      (``q_norm``: Gemma 3, Qwen 3), ``[heads * dim]`` in float64;
    * the residual stream's energy at the block's input: the sum over tokens of its mean square;
    * the gain per hidden channel of whatever the block applies to the attention's output before adding it to the
      residual stream (Gemma's post-attention RMSNorm divides it by its RMS and multiplies by a learned weight):
      the least-squares slope of that module's output on its input, per channel (1 where the output is added as
      it is, as in Llama).  It is found as the child module whose input is the attention's output tensor itself.
    """

    def __init__(self, blocks: Any, heads: int) -> None:
        self.query_energy: dict[int, torch.Tensor] = {}
        self.residual_energy: dict[int, torch.Tensor] = {}
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
                self.query_energy[idx] = q.reshape(q.shape[0], -1)[SINK_TOKENS:].double().pow(2).sum(0)

            def on_block(m: Any, args: Any, kwargs: Any, idx: int = idx) -> None:
                x = args[0] if args else kwargs["hidden_states"]
                self.residual_energy[idx] = x[0, SINK_TOKENS:].double().pow(2).mean(-1).sum()

            def on_attention(m: Any, i: Any, o: Any, idx: int = idx) -> None:
                self._attn_out[idx] = o[0] if isinstance(o, tuple) else o

            def on_child(m: Any, i: Any, o: Any, idx: int = idx) -> None:
                if i and i[0] is self._attn_out.get(idx) and isinstance(o, torch.Tensor) and o.shape == i[0].shape:
                    x, y = i[0].detach().double().reshape(-1, o.shape[-1]), o.detach().double().reshape(-1, o.shape[-1])
                    self._cross[idx] = self._cross.get(idx, 0) + (x * y).sum(0)
                    self._square[idx] = self._square.get(idx, 0) + x.pow(2).sum(0)

            self._hooks.append(attn.q_proj.register_forward_hook(on_query))
            self._hooks.append(block.register_forward_pre_hook(on_block, with_kwargs=True))
            self._hooks.append(attn.register_forward_hook(on_attention))
            self._hooks += [child.register_forward_hook(on_child) for child in block.children() if child is not attn]

    def output_gain(self, idx: int) -> torch.Tensor:
        """Per hidden channel, how much of a change in the attention's output reaches the residual stream."""
        if idx not in self._cross:
            return torch.ones(1, dtype=torch.float64)
        return self._cross[idx] / self._square[idx].clamp_min(1e-30)

    def forget_segment(self) -> None:
        """Drop the last segment's energies and attention outputs, so they are not held while the next segment
        runs."""
        self.query_energy.clear()
        self.residual_energy.clear()
        self._attn_out.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@torch.no_grad()
def collect_statistics(loaded: Any, texts: Sequence[str] = DEFAULT_CALIBRATION_TEXTS, *,
                       group_layers: int | None = None, segment_tokens: int = SEGMENT_TOKENS,
                       max_tokens: int | None = None, text_tokens: int | None = DEFAULT_TEXT_TOKENS,
                       undo_rope: bool = True, progress: Any = None) -> Statistics:
    """Run ``loaded`` (a :class:`kvcodec.models.LoadedModel`) over ``texts`` (specs for
    :func:`kvcodec.texts.load_text`) in segments of ``segment_tokens`` and accumulate the calibration
    statistics of the groups ``group_layers`` gives (see :func:`default_groups`), from at most ``text_tokens`` of
    each text (None: all of it) and ``max_tokens`` in all.  Memory: the model, one segment's
    activations, and the groups' moments (``8·(F² + 2F)`` bytes per group and K/V, F its width)."""
    from transformers import DynamicCache

    model = loaded.model
    cfg = model.config
    layers = model_layers(model)
    if not undo_rope:
        layers = [LayerInfo(l.heads, l.key_dim, l.value_dim, None) for l in layers]
    layer_types = getattr(cfg, "layer_types", None) or []
    windowed = [t == "sliding_attention" for t in layer_types]
    groups = default_groups(layers, group_layers, windowed)
    nq = cfg.num_attention_heads
    blocks = model.model.layers
    if not all(hasattr(b, "self_attn") and hasattr(b.self_attn, "q_proj") and hasattr(b.self_attn, "o_proj") for b in blocks):
        raise InvalidInputError("kvtc calibration needs attention layers with q_proj and o_proj (Llama, Qwen, Gemma, ...)")
    segments = []
    for spec in texts:
        ids = loaded.tokenize(load_text(spec))[:text_tokens]
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
    moments = {kind: [Moments(sum(layers[i].heads * getattr(layers[i], dim) for i in members)) for members in groups]
               for kind, dim in (("keys", "key_dim"), ("values", "value_dim"))}
    taps = _AttentionTaps(blocks, nq)
    # the decoder stack without its language-model head: the logits (a fifth of the work, and 400 MB a segment
    # for SmolLM2's 49k-token vocabulary) are not needed
    body = model.model
    cache_arg = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"
    try:
        for seg in (progress(segments, len(segments)) if progress else segments):
            # A cache without the model's config keeps every token of every layer (a sliding-window layer's own
            # cache keeps only its window): the keys and values do not depend on it, and windowed layers then
            # give as many feature rows as the others.
            cache = DynamicCache()
            body(torch.tensor([seg]), use_cache=True, **{cache_arg: cache})
            kv = KVCache.from_hf(cache)
            n = len(seg)
            rows: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}
            for i, l in enumerate(layers):
                q_energy[i] += taps.query_energy[i].reshape(l.heads, nq // l.heads, l.key_dim).sum(1)
                resid_sq[i] += taps.residual_energy[i]
                k, v = kv.layers[i].keys.float(), kv.layers[i].values.float()
                t = k.shape[1]
                pos = torch.arange(n - t, n)
                if l.rotary is not None:
                    k = l.rotary.rotate(k, pos, inverse=True)
                keep = pos >= SINK_TOKENS
                rows["keys"].append(k[:, keep].permute(1, 0, 2).reshape(int(keep.sum()), -1))
                rows["values"].append(v[:, keep].permute(1, 0, 2).reshape(int(keep.sum()), -1))
            del kv, cache
            taps.forget_segment()
            for kind, per_layer in rows.items():
                for members, m in zip(groups, moments[kind]):
                    m.add(torch.cat([per_layer[i] for i in members], 1))
            del rows, per_layer  # not held while the next segment runs
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
    settings = {"texts": list(texts), "text_tokens": text_tokens, "segment_tokens": segment_tokens, "tokens": counted,
                "undo_rope": undo_rope, "window": getattr(cfg, "sliding_window", None)}
    return Statistics(loaded.model_id, layers, windowed, groups, moments["keys"], moments["values"], key_weights,
                      value_weights, settings)


def _floored(weight: torch.Tensor) -> torch.Tensor:
    """Weights of at least ``WEIGHT_FLOOR`` times the layer's largest: a channel nothing reads (Gemma 3 270M's
    query norm zeroes some query channels, so their keys' weight is 0) must still be invertible; its error then
    costs next to nothing, as it should."""
    return weight.clamp_min(WEIGHT_FLOOR * float(weight.max()))


def calibrate(loaded: Any, texts: Sequence[str] = DEFAULT_CALIBRATION_TEXTS, *, group_layers: int | None = None,
              finest_steps: tuple[float, float] | None = None, segment_tokens: int = SEGMENT_TOKENS,
              max_tokens: int | None = None, text_tokens: int | None = DEFAULT_TEXT_TOKENS, undo_rope: bool = True,
              weight_keys: bool = True, weight_values: bool = True, loss_weights: bool | None = None,
              level_kl: float | None = LEVEL_KL, progress: Any = None, statistics: Statistics | None = None,
              sensitivity: Sensitivity | None = None) -> Calibration:
    """Compute a calibration of ``loaded`` from ``texts`` (see :func:`collect_statistics`, or pass ``statistics``
    already collected with the same or a coarser grouping, and ``sensitivity`` already measured with
    :func:`sensitivity.fisher_diagonals`; ``loaded`` may then be None).

    Unless ``loss_weights`` is False, the loss a unit of error costs in each layer and channel is measured with the
    model (:mod:`kvcodec.codecs.kvtc.sensitivity`, about a minute of CPU), and used twice:

    * where the model has sliding-window and full layers (with ``loss_weights=True`` always), each layer's key and
      value weights are scaled so that a unit of error costs the same loss in every layer
      (:func:`sensitivity.equalized_weights`): the matrices' weights cannot see that fewer queries read a window;
    * every weight is scaled by one factor so that the default level's predicted KL is ``level_kl`` (None: not
      scaled): a level means about the same loss on every model (:func:`fit`).

    ``group_layers`` pools that many consecutive layers per basis (None: :func:`default_groups`' rule).
    ``undo_rope``, ``weight_keys``, ``weight_values`` and ``loss_weights`` switch off the design's parts, for
    measuring what each is worth.
    """
    if loss_weights is not False and sensitivity is None:  # first: its backward pass's memory is gone before the moments'
        if loaded is None:
            raise InvalidInputError("measuring the loss needs the model: pass it, or sensitivity=, or loss_weights=False")
        sensitivity = fisher_diagonals(loaded)
    stats = statistics or collect_statistics(loaded, texts, group_layers=group_layers, segment_tokens=segment_tokens,
                                             max_tokens=max_tokens, text_tokens=text_tokens, undo_rope=undo_rope,
                                             progress=progress)
    stats = stats.regroup(default_groups(stats.layers, group_layers, stats.windowed))
    key_weights = stats.key_weights if weight_keys else _flat(stats.key_weights, stats.groups)  # one per group
    value_weights = stats.value_weights if weight_values else _flat(stats.value_weights, stats.groups)
    settings = stats.settings | {"group_layers": group_layers, "weight_keys": weight_keys,
                                 "weight_values": weight_values, "loss_weights": loss_weights}
    sens = None if loss_weights is False else sensitivity
    if sens is not None:
        # by default only where layers of several kinds (sliding windows and full) share one step
        # (docs/codecs/kvtc.md, "Defaults on every model": a rule on the traces' spread could not tell models apart)
        on = bool(loss_weights) or len(set(stats.windowed)) > 1
        if on:
            key_weights, value_weights = equalized_weights(None, key_weights, value_weights, layers=stats.layers,
                                                           sensitivity=sens)
        settings |= {"equalized": on}
    return fit(stats, finest_steps, settings, key_weights, value_weights, sens, level_kl)


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
    stats = Statistics.from_rows(model, layers, groups, keys_pre, values, key_weights, value_weights, settings)
    return fit(stats, finest_steps, settings)


def fit(stats: Statistics, finest_steps: tuple[float, float] | None = None, settings: dict[str, Any] | None = None,
        key_weights: list[torch.Tensor] | None = None, value_weights: list[torch.Tensor] | None = None,
        sensitivity: Sensitivity | None = None, level_kl: float | None = None) -> Calibration:
    """The PCA bases of each group of ``stats`` (weighted by its weights, or those given): per group and K/V the
    components whose std is at least ``TRUNCATE_FRACTION`` times the finest step (default: the finest level's).

    With a measured ``sensitivity``, the settings record each level's predicted KL (:func:`sensitivity.predicted_kl`)
    and, given a ``level_kl``, every weight is first multiplied by the one factor (within ``MAX_LEVEL_SCALE``
    either way) that makes the default level's ``level_kl``: a level then means about the same loss on every model
    (see :data:`levels.LEVEL_KL`)."""
    if finest_steps is None:
        finest_steps = (min(k for k, _ in LEVELS.values()), min(v for _, v in LEVELS.values()))
    floors = (TRUNCATE_FRACTION * finest_steps[0], TRUNCATE_FRACTION * finest_steps[1])
    measured = sensitivity is not None
    reach = MAX_LEVEL_SCALE if measured and level_kl is not None else 1.0  # what a larger scale keeps is fitted too
    weights = {"keys": key_weights or stats.key_weights, "values": value_weights or stats.value_weights}
    costs = {kind: sensitivity.costs(kind, w) for kind, w in weights.items()} if measured else {}
    bases: dict[str, list[GroupBasis]] = {"keys": [], "values": []}
    losses: list[tuple[PartLoss, float]] = []
    for g, members in enumerate(stats.groups):
        for (kind, moments), floor, step in zip((("keys", stats.keys), ("values", stats.values)), floors,
                                                LEVELS[DEFAULT_LEVEL]):
            w = torch.cat([weights[kind][i].reshape(-1) for i in members]).double()
            cost = torch.cat([costs[kind][i] for i in members]) if measured else None
            graded = DEFAULT_WINDOW_OCTAVES if any(stats.windowed[i] for i in members if i < len(stats.windowed)) else 0.0
            basis, loss = _basis(moments[g], w, floor / reach, cost, graded)
            bases[kind].append(basis)
            if loss is not None:
                losses.append((loss, step))
    settings = dict(settings if settings is not None else stats.settings) | {"floor_std": list(floors)}
    if measured:
        scale = 1.0 if level_kl is None else level_kl_scale(losses, level_kl, DEFAULT_MIN_STD, (1 / reach, reach))
        # losses alternate keys and values
        predicted = {str(level): round(predicted_kl([(l, steps[i % 2]) for i, (l, _) in enumerate(losses)],
                                                    DEFAULT_MIN_STD, scale), 6) for level, steps in LEVELS.items()}
        settings |= {"level_kl": level_kl, "level_scale": round(scale, 6), "predicted_kl": predicted,
                     "unscaled_kl": round(predicted_kl(losses, DEFAULT_MIN_STD), 6)}
        for kind, floor in zip(("keys", "values"), floors):
            bases[kind] = [_scaled(b, scale, floor) for b in bases[kind]]
    return Calibration(stats.model, stats.layers, stats.groups, bases["keys"], bases["values"], settings)


def _basis(moments: Moments, w: torch.Tensor, min_std: float, cost: torch.Tensor | None = None,
           graded: float = 0.0) -> tuple[GroupBasis, PartLoss | None]:
    """PCA of the weighted feature rows, components with std >= ``min_std``; with per-feature ``cost``s, also what
    quantizing them costs (:class:`sensitivity.PartLoss`; ``graded``: the window grading's octaves)."""
    # measured on SmolLM2: the fit's peak resident memory was 2.94 GB without this and 2.62 GB with it (its large
    # arrays, each mapped on its own, cannot reuse what the model run left in the heaps)
    return_freed_memory()
    cov = moments.covariance(w)
    var, vec, _ = leading_eigenpairs(cov, min_std ** 2)
    loss = PartLoss.of(cov, var, vec, cost, graded) if cost is not None else None
    del cov
    # a deterministic sign: each component's largest entry positive
    sign = torch.sign(vec.gather(0, vec.abs().argmax(0, keepdim=True)))
    vec = vec * torch.where(sign == 0, 1.0, sign)
    return GroupBasis(moments.mean.float(), w.float(), vec.half(), var.float()), loss


def _scaled(basis: GroupBasis, scale: float, min_std: float) -> GroupBasis:
    """``basis`` with its weights ``scale`` times larger, keeping the components whose std is then at least
    ``min_std`` (at least one)."""
    variance = basis.variance.double() * scale * scale
    keep = max(1, int((variance >= min_std ** 2).sum()))
    return GroupBasis(basis.mean, (basis.weight.double() * scale).float(), basis.basis[:, :keep].contiguous(),
                      variance[:keep].float())


def ensure_calibration(loaded: Any, log: Any = None, *, model_digest: str = "", **options: Any) -> Calibration:
    """The calibration installed for ``loaded``'s model, or a new one computed now (with ``options`` for
    :func:`calibrate`), installed in the cache folder and announced through ``log`` (a callable taking a line):
    how tools and engine hooks that have the model get one on first use.  The model is known by ``model_digest``
    (its identity: :func:`kvcodec.store.identity.model_identity`), which a new calibration records and is
    installed under; without one, by ``loaded.model_id`` (a name, as calibrations were named before)."""
    key = model_digest or loaded.model_id
    cal = calibration_for_model(key)
    if cal is not None:
        return register_calibration(cal)
    if log:
        log(f"kvtc: no calibration of {loaded.model_id} ({key}) installed; calibrating it now (once) into "
            f"{cache_dir()}")
    cal = calibrate(loaded, **options)
    if model_digest:
        cal = cal.of_model(model_digest)
    path = install(cal)
    if log:
        log(f"kvtc: calibration {cal.digest} of {loaded.model_id} ({key}) installed as {path}")
    return register_calibration(cal)
