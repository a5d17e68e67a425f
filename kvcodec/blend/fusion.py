"""Fusing stored segments into one prompt's KV, the model-generic half (an engine hook runs the model):

1. :class:`SegmentLoads` loads the segments of a prompt ``anchor + segment_1 + ... + segment_k`` from a
   :class:`~kvcodec.blend.segments.SegmentStore` in the background, in prompt order, each one's keys moved from
   the positions it was computed at to its positions in this prompt (:func:`kvcodec.positions.reposition`), and
   marks the tokens no store held (the anchor, a segment missed, the tail of one whose later chunk is missing or
   bad, or whose load would be slower than computing it) as *forced*: recomputed at every layer.
2. The engine recomputes, segment by segment as each one is in, the tokens a :class:`RecomputeSchedule` selects,
   through every layer, with attention over the fused cache, writing their new keys and values into it; a
   segment's KV *deviation* (:func:`deviation`, new against stored) at the first layers narrows its selection for
   the next layers (*gradual filtering*).  Attention is causal, so a segment's recompute needs only the segments
   before it: it runs while the later ones load.  Every other token keeps its stored KV, which lacks the attention
   to the segments before it: the recomputed tokens are the ones whose KV that changes most, and through them later
   tokens (the question) see the cross-segment context.
3. The suffix (the question) is then computed as usual over the fused cache.

When the caller does not fix the share, the *loading controller* (:func:`controlled_share`) picks it from what the
loads still to come cost (the store's own estimates of its links and decode rates, :func:`estimated_load_s`)
against what recomputing costs (measured on the fusion's own first layers, which run over every token): the share
whose recompute takes as long as those loads, never below :data:`SHARE_FLOOR`.  The loads themselves stop where
the engine recomputing the rest of a segment is sooner (``recompute_tps``, the store's own rule).

A :class:`FusionReport` says what was reused, recomputed (per layer) and missed, and the share chosen and why.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from kvcodec.blend.segments import SegmentStore
from kvcodec.errors import InvalidInputError
from kvcodec.positions import Rotary, reposition
from kvcodec.store.chunks import ChunkShape
from kvcodec.store.plan import LoadPlanner, Option

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
    store (the rest were recomputed at every layer), where each loaded chunk came from and in which variant (codec
    id), and whether it was ``computed`` by choice (:func:`computed_front`) rather than missed."""

    start: int
    tokens: int
    loaded: int
    tiers: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    computed: bool = False  # not loaded by choice: computed while the segments after it loaded

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

    @classmethod
    def of(cls, context: FusedContext, done: Recomputed, *, suffix_tokens: int = 0, suffix_s: float = 0.0,
           first_token_s: float) -> FusionReport:
        """The report of ``context`` fused by ``done`` (:func:`recompute`), then ``suffix_tokens`` computed in
        ``suffix_s``, ``first_token_s`` in all."""
        forced = int(context.forced.sum())
        return cls(context.num_tokens + suffix_tokens, context.num_tokens, context.num_tokens - forced, forced,
                   done.share.share, done.counts, context.segments, context.nbytes, context.load_s, done.seconds,
                   suffix_s, first_token_s, done.share.reason)

    @property
    def hits(self) -> int:
        return sum(s.hit for s in self.segments)

    @property
    def computed(self) -> int:
        """Segments computed by choice, while the later ones loaded."""
        return sum(s.computed for s in self.segments)

    @property
    def misses(self) -> int:
        return len(self.segments) - self.hits - self.computed

    @property
    def recomputed_share(self) -> float:
        """The share of the context's token-layers computed: 1.0 is a full prefill's work (before the suffix)."""
        return sum(self.recomputed) / (len(self.recomputed) * self.context_tokens) if self.recomputed else 0.0

    def _sources(self) -> str:
        """The loaded chunks' variants and tiers, as " (raw x3, cachegen x1 from redis)"."""
        variants = [v for s in self.segments for v in s.variants]
        if not variants:
            return ""
        counts = ", ".join(f"{v} x{variants.count(v)}" for v in dict.fromkeys(variants))
        return f" ({counts} from {', '.join(dict.fromkeys(t for s in self.segments for t in s.tiers))})"

    def summary(self) -> str:
        return (f"{self.context_tokens} context tokens: {self.reused_tokens} reused, {self.forced_tokens} computed "
                f"(no stored KV); segments {self.hits} hit, {self.misses} missed, "
                f"{f'{self.computed} computed while the rest loaded, ' if self.computed else ''}"
                f"{self.nbytes / 1e6:.3g} MB loaded"
                f"{self._sources()}; recompute share {self.share:.0%} "
                f"({self.share_reason}), "
                f"{self.recomputed_share:.1%} of the token-layers computed; first token in "
                f"{self.first_token_s * 1e3:.0f} ms (load {self.load_s * 1e3:.0f}, recompute "
                f"{self.recompute_s * 1e3:.0f}, suffix {self.suffix_s * 1e3:.0f})")


class SegmentLoads:
    """The segments of one prompt (token id lists, in prompt order, after the store's anchor) loading into one
    context of ``shape`` (the model's layers, heads and head sizes) on a thread of their own, in prompt order, each
    one's keys moved to its positions in the prompt by ``rotary`` (the model's per-layer setting).
    ``recompute_tps`` (the engine's prefill speed, tokens/s) lets each segment's load stop where recomputing its
    rest is sooner.  The context's tensors (``layers``, ``forced``) exist from the start; a segment's part of them
    is written once, before :meth:`wait` returns its :class:`SegmentHit`, and the caller writes there only after.

    One thread: the loads run one after another, as each is itself a pipeline of fetch and decode threads
    (:class:`~kvcodec.store.load.PrefixLoad`), and in prompt order, which is the order the recompute needs them.
    With ``recompute_tps``, the first :attr:`front` segments are not loaded but computed, while the others load,
    where that ends the recompute sooner by the store's estimates (:func:`computed_front`, for the ``schedule`` the
    engine runs; one without a share at the loading controller's floor, :data:`SHARE_FLOOR`)."""

    def __init__(self, store: SegmentStore, segments: Sequence[Sequence[int]], shape: ChunkShape,
                 rotary: Sequence[Rotary | None], *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, recompute_tps: float | None = None,
                 schedule: RecomputeSchedule | None = None) -> None:
        if not segments:
            raise InvalidInputError("a fused prompt needs at least one segment")
        self.store, self.rotary, self.recompute_tps = store, rotary, recompute_tps
        self.device, self.dtype = device, dtype or getattr(torch, shape.dtype)
        self.segments = [[int(t) for t in s] for s in segments]
        self.anchor = list(store.anchor)
        self.token_ids = self.anchor + [t for s in self.segments for t in s]
        n = len(self.token_ids)
        self.layers = [(torch.zeros(shape.heads, n, shape.key_dim, dtype=self.dtype, device=device),
                        torch.zeros(shape.heads, n, shape.value_dim, dtype=self.dtype, device=device))
                       for _ in range(shape.layers)]
        self.forced = torch.zeros(n, dtype=torch.bool)
        self.forced[:len(self.anchor)] = True
        self.starts = [len(self.anchor) + sum(len(s) for s in self.segments[:j]) for j in range(len(self.segments))]
        self.front = 0
        self._chosen: list[bool] = []  # of the front: computed by choice (False: not stored, a miss)
        if recompute_tps:
            schedule = schedule or RecomputeSchedule()
            compute = [len(seg) / recompute_tps for seg in self.segments]
            spread = segment_shares(SHARE_FLOOR if schedule.share is None else schedule.share,
                                    [(a, a + len(seg)) for a, seg in zip(self.starts, self.segments)])
            # a loaded segment is still computed at every token of the layers up to the check, then at its share
            full = min(1.0, (schedule.check_layer + 1) / shape.layers)
            partial = [c * (full + x * (1 - full)) for c, x in zip(compute, spread)]
            stored = store.load_estimates(self.segments)
            self.front = computed_front(stored, compute, partial)
            self._chosen = [estimate is not None for estimate in stored[:self.front]]
        self.hits: list[SegmentHit] = []
        self.nbytes = 0
        self.estimate_s = 0.0  # the store's estimate of the loads done so far
        self.load_s = 0.0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvcodec-segment-loads", daemon=True)

    def start(self) -> SegmentLoads:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            with self._cond:
                for seg, start, chosen in zip(self.segments, self.starts, self._chosen):
                    self.forced[start:start + len(seg)] = True
                    self.hits.append(SegmentHit(start, len(seg), 0, computed=chosen))
                self._cond.notify_all()
            for seg, start in zip(self.segments[self.front:], self.starts[self.front:]):
                found = self.store.load(seg, device=self.device, dtype=self.dtype, recompute_tps=self.recompute_tps)
                m = found.loaded
                if found.kv is not None:
                    moved = reposition(found.kv, range(start, start + m), self.rotary)
                    for (k, v), l in zip(self.layers, moved.layers):
                        k[:, start:start + m] = l.keys
                        v[:, start:start + m] = l.values
                with self._cond:
                    self.forced[start + m:start + found.tokens] = True
                    self.nbytes += found.load.nbytes
                    self.estimate_s += estimated_load_s(self.store.store, found.load.chunks)
                    loaded = [c for c in found.load.chunks if c.status == "loaded"]
                    self.hits.append(SegmentHit(start, found.tokens, m, [c.tier for c in loaded],
                                                [self.store.store.variants[c.variant].codec_id for c in loaded]))
                    self.load_s = time.perf_counter() - t0
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which waits on this thread
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def wait(self, j: int) -> SegmentHit:
        """Segment ``j``'s hit, once it is in the context (its KV written, what did not load marked forced)."""
        with self._cond:
            while len(self.hits) <= j and self._error is None:
                self._cond.wait()
            if len(self.hits) <= j:
                raise self._error
            return self.hits[j]

    def estimate_left_s(self) -> float:
        """The store's estimate of loading the segments not in yet: the loads done so far, per token, over the
        tokens still to come (0 once every segment is in)."""
        with self._cond:
            done = sum(h.tokens for h in self.hits if not h.computed)
            left = len(self.token_ids) - len(self.anchor) - sum(h.tokens for h in self.hits)
            return self.estimate_s / done * left if done else 0.0

    def context(self) -> FusedContext:
        """The whole context, once every segment is in."""
        self.wait(len(self.segments) - 1)
        self._thread.join()
        return FusedContext(self.token_ids, self.layers, self.forced, self.hits, self.load_s, self.nbytes,
                            self.estimate_s)


def estimated_load_s(store: Any, chunks: Sequence[Any]) -> float:
    """The seconds ``store`` (a :class:`~kvcodec.store.KVStore`) estimates loading ``chunks`` (a load's
    :class:`~kvcodec.store.load.ChunkOutcome` list; those loaded count) takes on the links and variants they came
    from: each one's read and decode by the load planner's estimates (as :meth:`KVStore.load_estimates`)."""
    planner = LoadPlanner(store.telemetry, store.variants)
    return sum(planner.fetch_s(o) + planner.decode_s(o, c.end - c.start)
               for c in chunks if c.status == "loaded" for o in [Option(c.variant, c.nbytes, c.tier)])


def computed_front(load_s: Sequence[float | None], compute_s: Sequence[float], partial_s: Sequence[float]) -> int:
    """How many of a prompt's first segments to compute at every layer instead of loading them, so that their
    compute runs while the later ones load: each segment takes ``load_s`` to load (None: not stored, computed when
    the recompute reaches it), ``compute_s`` to compute in full and, loaded, ``partial_s`` to recompute.  The
    recompute goes through the segments in order, waiting for each one loaded; the loads go in order from the first
    not computed.  The count whose recompute ends soonest, the largest of equals: on a link fast enough every segment
    loads, on a slow one the front is computed while the back loads (inside vLLM at 100 Mbit/s every raw segment
    loaded, one after another, 15 s for 177 MB, and fusion took 1.05-1.2x a full prefill)."""
    n = len(compute_s)
    if not len(load_s) == len(partial_s) == n:
        raise InvalidInputError(f"one estimate of each kind per segment, not {len(load_s)}, {n}, {len(partial_s)}")
    best, best_end = 0, math.inf
    for front in range(n + 1):
        end, loads = sum(compute_s[:front]), 0.0
        for j in range(front, n):
            if load_s[j] is None:
                end += compute_s[j]
                continue
            loads += load_s[j]  # type: ignore[operator]
            end = max(end, loads) + partial_s[j]
        if end <= best_end * (1 + 1e-9):  # of equals, the one that moves fewest bytes
            best, best_end = front, end
    while best and load_s[best - 1] is None:  # not stored: missed, not computed by choice
        best -= 1
    return best


@dataclass(frozen=True)
class ShareChoice:
    """The loading controller's answer: the recompute ``share`` and the ``reason`` (its estimates, in words)."""

    share: float
    reason: str


def controlled_share(load_s: float, layers: int, reusable: int, token_layer_s: float,
                     floor: float = SHARE_FLOOR) -> ShareChoice:
    """The recompute share that hides under loading (CacheBlend's loading controller).  ``load_s``: the store's
    estimate of the loads still to come (:meth:`SegmentLoads.estimate_left_s`), ``reusable`` the stored tokens
    still to recompute, ``token_layer_s`` the seconds per token per layer the model computes here.  Recomputing a
    share ``r`` of them through every layer takes ``r * reusable * layers * token_layer_s``, and runs while the
    loads do, so the share that costs nothing more is the one that takes as long: slow loading buys more
    recompute, up to every token; fast loading (or none left) never less than ``floor``, the quality floor."""
    if not (0.0 <= floor <= 1.0):
        raise InvalidInputError(f"the share floor is a fraction in 0..1, not {floor!r}")
    if load_s < 0 or token_layer_s < 0 or layers < 1 or reusable < 0:
        raise InvalidInputError(f"estimates are non-negative (and layers positive): load_s={load_s!r}, "
                                f"layers={layers!r}, reusable={reusable!r}, token_layer_s={token_layer_s!r}")
    per_layer = load_s / layers
    if reusable == 0 or token_layer_s == 0:
        return ShareChoice(1.0 if reusable else floor, "nothing to weigh: no reused tokens or no recompute cost")
    hidden = per_layer / (reusable * token_layer_s)
    why = (f"loading {per_layer * 1e3:.3g} ms/layer hides {min(hidden, 1.0):.1%} of {reusable} tokens at "
           f"{token_layer_s * 1e6:.3g} us/token-layer")
    if hidden <= floor:
        return ShareChoice(floor, f"quality floor: {why}")
    return ShareChoice(min(1.0, hidden), f"loading-bound: {why}")


def segment_shares(share: float, spans: Sequence[tuple[int, int]]) -> list[float]:
    """Each segment's share of its own tokens to recompute, for segments at prompt positions ``spans`` (start,
    end), so that together they recompute ``share`` of their tokens: in proportion to each one's mean position, none
    above 1 (what one cannot take goes to the others).  A token's KV deviates more the more context before it was
    missing when it was stored, and the recompute runs segment by segment, before the later segments' deviations
    are known: measured on SmolLM2 (3 prompts of 8 documents, 3,850 tokens, 32-token KL) at equal work, shares
    spread so gave KL 0.0336 at 15% and 0.0187 at 30%, the same share in every segment 0.0384 and 0.0287, and the
    top tokens of the whole prompt (which a recompute must wait for every segment to pick) 0.0375 and 0.0236; at
    2,040 tokens 0.0238 and 0.0158 against the whole prompt's 0.0270 and 0.0159."""
    if not 0.0 <= share <= 1.0:
        raise InvalidInputError(f"the recompute share is a fraction in 0..1, not {share!r}")
    sizes = [b - a for a, b in spans]
    mids = [(a + b) / 2 for a, b in spans]
    out = [0.0] * len(spans)
    left, free = share * sum(sizes), [g for g, n in enumerate(sizes) if n > 0]
    while free and left > 0:
        per_mid = left / sum(sizes[g] * mids[g] for g in free)
        full = [g for g in free if per_mid * mids[g] >= 1.0]
        if not full:
            for g in free:
                out[g] = per_mid * mids[g]
            break
        for g in full:
            out[g] = 1.0
            left -= sizes[g]
        free = [g for g in free if g not in full]
    return out


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


# Selected tokens are run through a layer in up to MAX_BLOCKS blocks of consecutive positions, each attending to
# the context up to its last token only: SDPA's CPU kernel with a mask computes the whole [queries, context]
# rectangle (it cannot skip the masked part as its causal path does), so in one block a selected token's attention
# costs about twice a causal prefill's.  Measured (SmolLM2 in transformers, 3,831 tokens, 30% share, 1 thread):
# attention 3.9-4.0 s in one block, 2.9-3.1 s in 4, for the whole recompute 1.03x, 1.00x, 1.05x (8 blocks of at
# least 128) and 1.39x (16 of 64): past 4, each call's copies of the context (transformers repeats the KV heads
# when a mask is given) and its overhead outweigh the shorter rectangles.
MAX_BLOCKS = 4
MIN_BLOCK = 256


@dataclass(frozen=True)
class QueryBlock:
    """One attention call over part of a selection: its rows ``start .. stop-1`` (positions within the selection),
    the context they read (positions below ``end``), and ``mask``: None where the rows are the context's first
    ``end`` tokens (a prefill's causal attention, which SDPA runs without a mask), else an additive
    ``[rows, end]`` mask that lets each row see the context up to its own position."""

    start: int
    stop: int
    end: int
    mask: torch.Tensor | None


def query_blocks(selected: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> list[QueryBlock]:
    """How an engine computes the attention of ``selected`` (ascending context positions): in up to
    :data:`MAX_BLOCKS` blocks of at least :data:`MIN_BLOCK` rows, each reading the context up to its last row;
    with ``window``, a row sees only the last ``window`` positions up to its own (a sliding-window layer)."""
    n = len(selected)
    if int(selected[-1]) + 1 == n and (window is None or n <= window):
        return [QueryBlock(0, n, n, None)]
    count = max(1, min(MAX_BLOCKS, n // MIN_BLOCK))
    cuts = [round(n * b / count) for b in range(count + 1)]
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        part = selected[a:b]
        end = int(part[-1]) + 1
        # additive, as SDPA turns a boolean mask into one at every call (2.7% of a 30% recompute's time, 3,831
        # tokens)
        allowed = torch.arange(end, device=selected.device)[None, :] <= part[:, None]
        if window is not None:
            allowed &= torch.arange(end, device=selected.device)[None, :] > part[:, None] - window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=selected.device).masked_fill_(~allowed, -math.inf)
        out.append(QueryBlock(a, b, end, mask))
    return out


class LayerRunner(Protocol):
    """An engine's model, run by :func:`recompute` over a selection of a fused context's tokens.  The runner owns
    the hidden states of the selected tokens and writes each layer's new keys and values into the context
    (:attr:`SegmentLoads.layers`) at their positions."""

    def start(self, selected: torch.Tensor) -> None:
        """Embed the tokens at context positions ``selected`` (ascending): the next layer computes them."""

    def layer(self, index: int, measure: bool) -> torch.Tensor | None:
        """Run decoder layer ``index`` over the selection; with ``measure``, return its :func:`token_changes`
        (``[4, selected]``, taken before the new keys and values replaced the stored ones)."""

    def narrow(self, keep: torch.Tensor) -> None:
        """Keep only positions ``keep`` (ascending, within the selection) for the next layers."""


@dataclass
class Recomputed:
    """What :func:`recompute` did: the tokens each layer computed, the seconds it took (waits for loads
    included), the share used and why, and the seconds per token-layer of the first layers over the whole context
    when they computed every token (else None): the model's prefill speed at this length."""

    counts: list[int]
    seconds: float
    share: ShareChoice
    token_layer_s: float | None = None


# Below this many tokens through the first layers, their time says more about the calls than about the tokens: the
# loading controller then takes the seconds per token-layer from the caller's prefill speed, where it has one.
MEASURE_TOKENS = 64


@torch.no_grad()
def recompute(runner: LayerRunner, loads: SegmentLoads, schedule: RecomputeSchedule, layers: int,
              prefill_tps: float | None = None) -> Recomputed:
    """Recompute, through ``runner``'s ``layers`` decoder layers, the tokens ``schedule`` selects over the context
    ``loads`` fills: the anchor, then each segment as soon as it is in, each through every layer while the later
    ones load.  Attention is causal, so a segment's tokens see only the anchor and the segments before it, which
    are final by then: the result is what computing layer by layer over the whole context gives with the same
    selection.  Each segment's selection is its own: every token up to the check layer, then its share of its
    tokens by deviation, the schedule's share spread over the segments by position (:func:`segment_shares`).  A
    schedule without a share gets the loading controller's at each segment's check layer, from the loads still to
    come and the seconds per token-layer measured so far (``prefill_tps``, tokens/s, the caller's estimate, stands
    in until enough tokens are measured)."""
    t0 = time.perf_counter()
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
            runner.start(sel)
        for i in range(layers):
            if not len(sel):
                break
            counts[i] += len(sel)
            measure = bool(reusable) and local.measures(i)
            changes = runner.layer(i, measure)
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
            if measure:
                keep = local.narrow(i, sel - a, deviation(changes).cpu(), forced)
                if len(keep) < len(sel):
                    sel = sel[keep]
                    runner.narrow(keep)
        if reusable:  # (a model no deeper than the check layer computed every token: share 1)
            shares.append((reusable, 1.0 if local.share is None else local.share))
    each = ", ".join(f"{x:.0%}" for _, x in shares)
    if schedule.share is not None:
        choice = ShareChoice(schedule.share, "given" + (f" (per segment: {each})" if len(shares) > 1 else ""))
    elif shares:  # the share over the reused tokens, the first segment's reason, then each one's share
        mean = sum(n * x for n, x in shares) / sum(n for n, _ in shares)
        choice = ShareChoice(mean, reasons[0] + (f" (per segment: {each})" if len(shares) > 1 else ""))
    else:  # nothing reusable: every token was computed
        choice = ShareChoice(0.0, "nothing reused")
    token_layer_s = measured_s / measured if measured >= MEASURE_TOKENS * (schedule.check_layer + 1) else None
    return Recomputed(counts, time.perf_counter() - t0, choice, token_layer_s)
