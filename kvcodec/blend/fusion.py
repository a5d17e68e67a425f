"""Fusing stored segments into one prompt's KV, the model-generic half (an engine hook runs the model):

1. :func:`assemble` loads each segment of a prompt ``anchor + segment_1 + ... + segment_k`` from a
   :class:`~kvcodec.blend.segments.SegmentStore`, moves its keys from the positions it was computed at to its
   positions in this prompt (:func:`kvcodec.positions.reposition`), and marks the tokens no store held (the anchor,
   a segment missed, the tail of one whose later chunk is missing or bad) as *forced*: recomputed at every layer.
2. The engine recomputes, layer by layer, the tokens a :class:`RecomputeSchedule` selects, with attention over the
   fused cache, writing their new keys and values into it; each layer's KV *deviation* (:func:`deviation`, new
   against stored) narrows the selection for the next layers (*gradual filtering*).  Every other token keeps its
   stored KV, which lacks the attention to the segments before it: the recomputed tokens are the ones whose KV
   that changes most, and through them later tokens (the question) see the cross-segment context.
3. The suffix (the question) is then computed as usual over the fused cache.

When the caller does not fix the share, the *loading controller* (:func:`controlled_share`) picks it from what
loading costs here (the store's own estimates of its links and decode rates, :func:`estimated_load_s`) against what
recomputing costs (measured on the fusion's own first layers, which run over every token): the share whose
recompute of one layer takes as long as loading one layer, never below :data:`SHARE_FLOOR`, and capped (the loads
still run before the recompute) where load and recompute together would pass recomputing everything.  The loads
themselves stop where the engine recomputing the rest of a segment is sooner (``recompute_tps``, the store's own
rule), and what did not load is computed at every layer.

A :class:`FusionReport` says what was reused, recomputed (per layer) and missed, and the share chosen and why.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvcodec.blend.segments import SegmentStore
from kvcodec.errors import InvalidInputError
from kvcodec.positions import Rotary, reposition
from kvcodec.store.chunks import ChunkShape

# The share of a prompt's reused tokens recomputed at every layer past the filtering, by default: the knee of
# quality against work that bench/segment_reuse.py measured on SmolLM2, the last share whose step up still cut the
# KL more per token-layer than recomputing everything does on average (bench/results/segment_reuse.md, 2,040
# tokens: 0.050 nats at 0%, 0.037 at 5%, 0.019 at 15%, 0.011 at 30%, 0.0090 at 50%; segment_reuse-4k.md, 3,850
# tokens: 0.049, 0.025 at 15%, 0.015 at 30%, 0.0057 at 50%, where 30 -> 50% is on the line).
DEFAULT_SHARE = 0.3
# The layer whose deviation is computed over every token (layer 0's KV depends on a token alone, so its deviation
# is only the codec's error), and how much wider than the final share its selection is before the next layer
# narrows it: a token's deviation at one early layer predicts later layers' only roughly.  Against it, on two sets of
# 1,040-token prompts (docs/segments.md, "Why the KL stays above"): deviation of the values only, 1x or 3x widening,
# narrowing over 4 layers, each document's first 8 tokens pinned; none beat it on both sets by more than the spread
# between prompts (values only: KL 0.0320 against 0.0370 at 15% on one set, 0.0574 against 0.0581 on the other).
CHECK_LAYER = 1
WIDEN = 2.0
# The lowest share the loading controller picks, however fast loading is: below it quality falls off faster than
# work does (the knee, bench/results/segment_reuse.md).
SHARE_FLOOR = DEFAULT_SHARE


@dataclass
class SegmentHit:
    """One segment of a fused prompt: its first token's index in the prompt, its tokens, how many loaded from the
    store (the rest were recomputed at every layer), and where each loaded chunk came from."""

    start: int
    tokens: int
    loaded: int
    tiers: list[str] = field(default_factory=list)

    @property
    def hit(self) -> bool:
        return self.loaded == self.tokens


@dataclass
class FusedContext:
    """The KV of ``token_ids`` (the anchor and the segments) as assembled from the store: per layer keys (at their
    positions in the prompt, after RoPE) and values ``[H, N, D]``; ``forced`` ``[N]`` marks the tokens the store
    did not hold, which every layer recomputes."""

    token_ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    forced: torch.Tensor
    segments: list[SegmentHit]
    load_s: float = 0.0
    nbytes: int = 0
    load_estimate_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class FusionReport:
    """What a fusion did: the prompt's tokens (``context_tokens`` before the suffix), those whose stored KV was
    used (``reused_tokens``), those recomputed at every layer because no store held them (``forced_tokens``, the
    anchor included), the share of them recomputed past the filtering (``share``) and why that share
    (``share_reason``: the caller's, or the loading controller's estimates), the tokens recomputed at each layer
    (``recomputed``), each segment, the bytes loaded, and the seconds spent loading (and decoding), recomputing, on
    the suffix and in all (to the first token's logits)."""

    prompt_tokens: int
    context_tokens: int
    reused_tokens: int
    forced_tokens: int
    share: float
    recomputed: list[int]
    segments: list[SegmentHit]
    nbytes: int = 0
    load_s: float = 0.0
    recompute_s: float = 0.0
    suffix_s: float = 0.0
    first_token_s: float = 0.0
    share_reason: str = "given"

    @property
    def hits(self) -> int:
        return sum(s.hit for s in self.segments)

    @property
    def misses(self) -> int:
        return len(self.segments) - self.hits

    @property
    def recomputed_share(self) -> float:
        """The share of the context's token-layers computed: 1.0 is a full prefill's work (before the suffix)."""
        return sum(self.recomputed) / (len(self.recomputed) * self.context_tokens) if self.recomputed else 0.0

    def summary(self) -> str:
        return (f"{self.context_tokens} context tokens: {self.reused_tokens} reused, {self.forced_tokens} computed "
                f"(no stored KV); segments {self.hits} hit, {self.misses} missed; recompute share {self.share:.0%} "
                f"({self.share_reason}), "
                f"{self.recomputed_share:.1%} of the token-layers computed; first token in "
                f"{self.first_token_s * 1e3:.0f} ms (load {self.load_s * 1e3:.0f}, recompute "
                f"{self.recompute_s * 1e3:.0f}, suffix {self.suffix_s * 1e3:.0f})")


def assemble(store: SegmentStore, segments: Sequence[Sequence[int]], shape: ChunkShape,
             rotary: Sequence[Rotary | None], *, device: torch.device | str | None = None,
             dtype: torch.dtype | None = None, recompute_tps: float | None = None) -> FusedContext:
    """Load ``segments`` (token id lists, in prompt order, after the store's anchor) into one context of
    ``shape`` (the model's layers, heads and head sizes), each segment's keys moved to its positions in the
    prompt by ``rotary`` (the model's per-layer setting).  ``recompute_tps`` (the engine's prefill speed, tokens/s)
    lets each segment's load stop where recomputing its rest is sooner; the rest is then forced."""
    if not segments:
        raise InvalidInputError("a fused prompt needs at least one segment")
    anchor = list(store.anchor)
    token_ids = anchor + [int(t) for s in segments for t in s]
    n = len(token_ids)
    dtype = dtype or getattr(torch, shape.dtype)
    layers = [(torch.zeros(shape.heads, n, shape.key_dim, dtype=dtype, device=device),
               torch.zeros(shape.heads, n, shape.value_dim, dtype=dtype, device=device)) for _ in range(shape.layers)]
    forced = torch.zeros(n, dtype=torch.bool)
    forced[:len(anchor)] = True
    hits, start, nbytes, estimate_s = [], len(anchor), 0, 0.0
    t0 = time.perf_counter()
    for seg in segments:
        found = store.load(seg, device=device, dtype=dtype, recompute_tps=recompute_tps)
        nbytes += found.load.nbytes
        estimate_s += estimated_load_s(store.store, found.load.chunks)
        m = found.loaded
        if found.kv is not None:
            moved = reposition(found.kv, range(start, start + m), rotary)
            for (k, v), l in zip(layers, moved.layers):
                k[:, start:start + m] = l.keys
                v[:, start:start + m] = l.values
        forced[start + m:start + found.tokens] = True
        hits.append(SegmentHit(start, found.tokens, m, [c.tier for c in found.load.chunks if c.status == "loaded"]))
        start += found.tokens
    return FusedContext(token_ids, layers, forced, hits, time.perf_counter() - t0, nbytes, estimate_s)


def estimated_load_s(store: Any, chunks: Sequence[Any]) -> float:
    """The seconds ``store`` (a :class:`~kvcodec.store.KVStore`) estimates loading ``chunks`` (a load's
    :class:`~kvcodec.store.load.ChunkOutcome` list; those loaded count) takes on the links and variants they came
    from: each one's bytes over its tier's throughput estimate, plus its tokens at its variant's decode rate."""
    telemetry, variants = store.telemetry, store.variants
    return sum(c.nbytes / telemetry.link(c.tier).throughput.estimate
               + (c.end - c.start) / telemetry.decode_rate(variants[c.variant]).estimate
               for c in chunks if c.status == "loaded")


@dataclass(frozen=True)
class ShareChoice:
    """The loading controller's answer: the recompute ``share`` and the ``reason`` (its estimates, in words)."""

    share: float
    reason: str


def controlled_share(load_s: float, layers: int, reusable: int, token_layer_s: float,
                     floor: float = SHARE_FLOOR) -> ShareChoice:
    """The recompute share that hides under loading (CacheBlend's loading controller), within what keeps the fusion
    from taking longer than recomputing everything.  Loading one layer of the segments takes ``load_s / layers``
    (``load_s``: :func:`estimated_load_s` of all of them), recomputing a share ``r`` of the ``reusable`` tokens at one
    layer ``r * reusable * token_layer_s`` (``token_layer_s``: seconds per token per layer, as the model computes
    here), so when layer l+1 loads while layer l recomputes, the share that costs nothing more is their ratio: slow
    loading buys more recompute, fast loading never less than ``floor``, the quality floor.

    The segments still load before the recompute starts (the overlap is not built), so the recompute adds to the
    load: the share is capped where load and recompute together would take as long as recomputing every reused
    token (``1 - load_s / (layers * reusable * token_layer_s)``), and never set below ``floor``."""
    if not (0.0 <= floor <= 1.0):
        raise InvalidInputError(f"the share floor is a fraction in 0..1, not {floor!r}")
    if load_s < 0 or token_layer_s < 0 or layers < 1 or reusable < 0:
        raise InvalidInputError(f"estimates are non-negative (and layers positive): load_s={load_s!r}, "
                                f"layers={layers!r}, reusable={reusable!r}, token_layer_s={token_layer_s!r}")
    per_layer = load_s / layers
    if reusable == 0 or token_layer_s == 0:
        return ShareChoice(1.0 if reusable else floor, "nothing to weigh: no reused tokens or no recompute cost")
    hidden = per_layer / (reusable * token_layer_s)
    cap = 1.0 - hidden
    why = (f"loading {per_layer * 1e3:.3g} ms/layer hides {min(hidden, 1.0):.1%} of {reusable} tokens at "
           f"{token_layer_s * 1e6:.3g} us/token-layer")
    if min(hidden, cap) <= floor:
        return ShareChoice(floor, f"quality floor: {why}" + (f"; capped at {max(cap, 0.0):.1%}, as the load runs "
                                                              "before the recompute" if cap < hidden else ""))
    if cap < hidden:
        return ShareChoice(cap, f"capped: {why}, but the load runs before the recompute, and past {cap:.1%} the "
                                "two would take longer than recomputing every token")
    return ShareChoice(hidden, f"loading-bound: {why}")


def token_changes(old_k: torch.Tensor, new_k: torch.Tensor, old_v: torch.Tensor, new_v: torch.Tensor) -> torch.Tensor:
    """``[4, tokens]`` for tensors ``[..., heads, tokens, dim]``: each token's squared change of its keys, its
    stored keys' squared norm, and the same two of its values; :func:`deviation` weighs them.  Kept apart so that
    a layer computed in several calls is weighed as one."""
    def part(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dims = [d for d in range(old.dim()) if d != old.dim() - 2]
        old = old.float()
        return (new.float() - old).pow(2).sum(dims), old.pow(2).sum(dims)

    return torch.stack([*part(old_k, new_k), *part(old_v, new_v)])


def deviation(changes: torch.Tensor) -> torch.Tensor:
    """Each token's KV deviation from its :func:`token_changes`: the squared change of its keys and of its values,
    each over the mean squared norm of the stored ones, so that neither the keys' larger scale nor a layer's decides
    alone."""
    return changes[0] / changes[1].mean().clamp_min(1e-12) + changes[2] / changes[3].mean().clamp_min(1e-12)


@dataclass(frozen=True)
class RecomputeSchedule:
    """Which tokens each layer recomputes.  ``share`` (0..1) of the reused tokens are recomputed at every layer past
    the filtering, besides the forced ones.  With any share: every token at layers ``0 .. check_layer``; then the
    ``widen`` x share with the largest deviation at ``check_layer``; from the next layer on, the share with the
    largest deviation there among those.  Share 0 recomputes the forced tokens only (the segments' KV as it is);
    share 1 every token at every layer (a full prefill's result, through the fused path); share None leaves it to
    the loading controller (:func:`controlled_share`), which the engine asks once ``check_layer`` has run."""

    share: float | None = DEFAULT_SHARE
    check_layer: int = CHECK_LAYER
    widen: float = WIDEN

    def __post_init__(self) -> None:
        if self.share is not None and not (isinstance(self.share, (int, float)) and 0.0 <= self.share <= 1.0):
            raise InvalidInputError(f"the recompute share is a fraction in 0..1, not {self.share!r}")
        if not (isinstance(self.check_layer, int) and self.check_layer >= 1):
            raise InvalidInputError(f"check_layer is a layer index of at least 1, not {self.check_layer!r}")
        if not self.widen >= 1.0:
            raise InvalidInputError(f"widen is at least 1, not {self.widen!r}")

    def first(self, forced: torch.Tensor) -> torch.Tensor:
        """The tokens (indices, ascending) layer 0 computes."""
        return torch.arange(len(forced)) if self.share is None or self.share > 0 else forced.nonzero().flatten()

    def measures(self, layer: int) -> bool:
        """Whether :meth:`narrow` reads ``layer``'s deviations (it keeps every token after the other layers)."""
        return layer in (self.check_layer, self.check_layer + 1)

    def narrow(self, layer: int, selected: torch.Tensor, dev: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
        """After ``layer`` computed ``selected`` (indices) with deviations ``dev``: the positions within
        ``selected`` that the next layer computes (ascending), forced tokens always among them."""
        everything = torch.arange(len(selected))
        if not self.measures(layer):
            return everything
        if self.share is None:
            raise InvalidInputError("the share is the loading controller's: set it (dataclasses.replace) once "
                                    "the check layer has run")
        if self.share == 0:
            return everything
        reusable = int((~forced).sum())
        share = min(1.0, self.share * self.widen) if layer == self.check_layer else self.share
        want = math.ceil(share * reusable)
        is_forced = forced[selected]
        free = (~is_forced).nonzero().flatten()
        if want >= len(free):
            return everything
        top = free[torch.topk(dev[free].float(), want).indices]
        keep = torch.cat([is_forced.nonzero().flatten(), top])
        return keep.sort().values
