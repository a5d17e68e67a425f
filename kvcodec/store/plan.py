"""Adaptation at load time: which stored variant of each chunk to fetch, or where to stop loading and let the engine
recompute the rest.

A store may keep each chunk in several variants (``KVStore(codec=["kvtc:level=0", "cachegen", "raw"])``, smallest
first; every variant must meet the deployment's quality floor).  A load streams chunks through two stages that
run at once, a fetch thread on the link and a decode thread on the CPU (or device).  A small variant is cheap on
the link and dear to decode, a large one the reverse, so where they cost about the same, mixing them keeps both
stages busy and ends the load sooner than either alone.  Fetching a variant takes its bytes over the estimated
throughput of the tier holding it (:attr:`KVStore.links`, from the store's own recent reads: the harmonic mean of
the last few, which drops at once when the link does); decoding it takes its tokens at the variant's decode rate
(:meth:`KVStore.decode_rate`, from the store's own recent decodes), after the decode work already queued
(:class:`DecodeBacklog`).  Before a chunk is fetched the planner estimates, for each variant, when the whole load
would end if this chunk came in that variant and the rest in the best mix (:func:`finish_s`), and takes the
soonest, or the best (latest listed) variant ending within ``slack`` of one chunk's time after it.  When the engine
recomputing the rest at ``recompute_tps`` (tokens per second of prefill the engine hook observed) would be sooner,
the load stops there; without ``recompute_tps`` it never stops.  It decides again before every chunk, so a link that slows down in the
middle of a request moves the rest of it to smaller variants, or to recomputing.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvcodec.errors import InvalidInputError

if TYPE_CHECKING:
    from kvcodec.store.store import KVStore

DEFAULT_SLACK = 0.05
# Variants are mixed only when the mix promises to end the load at least this much sooner than the best variant
# alone: on vLLM CPU over an unshaped link, a mix predicted a little sooner than raw alone took 28% longer.
MIX_GAIN = 0.15


@dataclass(frozen=True)
class Option:
    """A variant of a chunk that a tier holds: its index in the store's variants, its bytes and the tier."""

    variant: int
    nbytes: int
    tier: str


class LoadPlanner:
    """Chooses per chunk (see the module doc).  ``recompute_tps``: the engine's prefill speed, or None."""

    def __init__(self, store: KVStore, *, recompute_tps: float | None = None, slack: float = DEFAULT_SLACK) -> None:
        if recompute_tps is not None and not recompute_tps > 0:
            raise InvalidInputError(f"recompute_tps must be positive, not {recompute_tps!r}")
        if not 0 <= slack < 1:
            raise InvalidInputError(f"slack must be in [0, 1), not {slack!r}")
        self.store, self.recompute_tps, self.slack = store, recompute_tps, slack
        self.variants = store.variants  # as the load's keys were made, whatever the store switches to meanwhile

    def stage_s(self, option: Option, tokens: int) -> tuple[float, float]:
        """Seconds to fetch and to decode one chunk of ``tokens`` tokens in ``option``."""
        fetch = option.nbytes / self.store.links[option.tier].estimate
        decode = tokens / self.store.decode_rate(self.variants[option.variant]).estimate
        return fetch, decode

    def done_s(self, option: Option, tokens: int, backlog_s: float, fetch_s: float | None = None) -> float:
        """Seconds until a chunk of ``tokens`` tokens in ``option``, fetched from now (in ``fetch_s``, default its
        estimate), is decoded after ``backlog_s`` seconds of queued decoding."""
        fetch, decode = self.stage_s(option, tokens)
        return max(backlog_s, fetch if fetch_s is None else fetch_s) + decode

    def choose(self, options: Sequence[Option], tokens: int, remaining_tokens: int,
               backlog_s: float = 0.0) -> Option | None:
        """The option to fetch for a chunk of ``tokens`` tokens with ``remaining_tokens`` (this chunk's included)
        still to load and ``backlog_s`` seconds of decoding already queued, or None to stop and recompute them."""
        if not options:
            return None
        stages = [self.stage_s(o, tokens) for o in options]
        rest = max(0, remaining_tokens - tokens) / tokens
        # this chunk in each option after the queued decoding, then the rest in the best mix, or in that option alone
        ends = {o: finish_s(f, max(backlog_s, f) + d, rest, stages) for o, (f, d) in zip(options, stages)}
        alone = {o: finish_s(f, max(backlog_s, f) + d, rest, [(f, d)]) for o, (f, d) in zip(options, stages)}
        if min(ends.values()) > (1 - MIX_GAIN) * min(alone.values()):
            ends = alone  # a mix must promise a clear gain: its two stages share the host's cores more than the model says
        soonest = min(ends.values())
        if self.recompute_tps is not None and soonest > backlog_s + remaining_tokens / self.recompute_tps:
            return None
        # the slack is a share of one chunk's time, not of the whole load's, which would grow with the prompt
        slack_s = self.slack * min(max(stage) for stage in stages)
        return max((o for o in options if ends[o] <= soonest + slack_s), key=lambda o: o.variant)


def finish_s(fetch_free: float, decode_free: float, count: float, stages: Sequence[tuple[float, float]]) -> float:
    """When both stages are through ``count`` more chunks, each taking (fetch, decode) seconds of one of ``stages``,
    with the fetch stage busy for ``fetch_free`` more seconds and the decode stage for ``decode_free``.  Chunks are
    taken as fluid (a chunk's decode may start before its fetch ends), and the mix as the best of every variant
    alone and every pair: with two stages to balance, an optimal mix needs at most two variants."""
    best = math.inf
    for fa, da in stages:
        for fb, db in stages:
            # with a share x of the first variant each stage's end is linear in x, so the least of the later of
            # the two is at x = 0, x = 1 or where they cross
            f0, df = fetch_free + count * fb, count * (fa - fb)
            d0, dd = decode_free + count * db, count * (da - db)
            shares = [0.0, 1.0] + ([(d0 - f0) / (df - dd)] if df != dd else [])
            best = min(best, min(max(f0 + x * df, d0 + x * dd) for x in shares if 0 <= x <= 1))
    return best


class DecodeBacklog:
    """The decode work a load has fetched or is fetching and not yet decoded, in estimated seconds: what a chunk
    chosen now waits for before its own decode starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, float] = {}  # chunk: estimated decode seconds
        self._current: tuple[int, float] | None = None  # the chunk being decoded, since when

    def add(self, chunk: int, seconds: float) -> None:
        with self._lock:
            self._pending[chunk] = seconds

    def begin(self, chunk: int) -> None:
        with self._lock:
            self._current = (chunk, time.perf_counter())

    def done(self, chunk: int) -> None:
        with self._lock:
            self._pending.pop(chunk, None)
            self._current = None

    def seconds(self, before: int) -> float:
        """The queued decode work chunk ``before`` waits for (chunks decode in order)."""
        with self._lock:
            total = sum(s for c, s in self._pending.items() if c < before)
            if self._current is not None and self._current[0] in self._pending and self._current[0] < before:
                estimate = self._pending[self._current[0]]
                total -= min(estimate, time.perf_counter() - self._current[1])
            return total
