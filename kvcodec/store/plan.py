"""Adaptation at load time: the estimates a load plans with, and where it stops loading and lets the engine recompute
the rest.

A store may keep each chunk in several variants (``KVStore(codec=["kvtc", "cachegen", "raw"])``, smallest first;
every variant must meet the deployment's quality floor).  A small variant is cheap on the link and dear to decode,
a large one the reverse.  A load (:class:`kvcodec.store.load.PrefixLoad`) runs two stages at once, a fetch thread
on the link and a decode thread on the CPU (or device), and loads from both ends: the link brings the largest
variant of the chunks from the front, which decode at once, while the decoder works back from the last chunk
through the smallest variant (a few percent of the large one's bytes).  Where the two meet, the load is done.  So
the link and the decoder are both busy whatever the link's speed, and no rate has to be right in advance.

Estimates still decide (:class:`LoadPlanner`): whether loading the rest is worth it at all, or the engine
recomputing it at ``recompute_tps`` (tokens per second of prefill the engine hook observed) would be sooner; whether
a large variant can still arrive before the decoder reaches its chunk from the back; whether the decoder could need
a chunk's small variant before its large one arrives (only then is it read); whether a small variant's decode ends
before the large variants coming would have its chunk in (only then does the decoder start it); and whether
decoding a small variant pays at all where the decoder and the link share a machine's cores
(:class:`~kvcodec.store.telemetry.Contention`): on a fast link a decode can slow the fetch by more than it saves.
Fetching takes a variant's bytes over the estimated throughput of the tier holding it, decoding takes its tokens at
the variant's decode rate, both from the store's own recent reads and decodes
(:class:`~kvcodec.store.telemetry.Telemetry`: the harmonic mean of the last few, started over by a read 4x faster,
or by two in a row 4x slower, so that it follows a rise within one read and most of a drop within one).
:mod:`kvcodec.store.load` argues the rules with measurements.

Each chunk's choice is kept as a :class:`Decision`: the rule that decided and the estimates it saw then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvcodec.codecs import Codec
from kvcodec.errors import InvalidInputError
from kvcodec.store.telemetry import Telemetry


@dataclass(frozen=True)
class Option:
    """A variant of a chunk that a tier holds: its index in the store's variants, its bytes and the tier."""

    variant: int
    nbytes: int
    tier: str


# The rules that decide a chunk (Decision.rule).
ONE_VARIANT = "one variant"  # a single variant of the chunk is held: nothing to choose
LARGE_IN_TIME = "large arrives in time"  # its large variant was read, as it could be in before the decoder got there
LARGE_PROBED = "large probed"  # ... read as a probe of the link once every small one was in, and in before the decoder
SMALL_UNMEASURED = "small's decode unmeasured"  # ... read because the small one was never decoded here
SMALL_PAYS = "small pays"  # its small variant's decode saves the link more than it slows it
LARGE_TOO_LATE = "large too late"  # the large variant would not be in before the decoder reached the chunk
LARGE_NOT_COMING = "large not coming"  # no large read was under way or to come (the fetch ended)
BUDGET_FULL = "budget full"  # the small variant was decoded to make room for the fetch
RECOMPUTE = "recompute sooner"  # the engine recomputing this chunk and the rest ends sooner than loading them


@dataclass(frozen=True)
class Decision:
    """Why a chunk loaded as it did: the ``rule`` that decided (one of this module's rule strings), the ``variant``
    it chose (None: the engine recomputes), and the planner's inputs then, for each of the variants it weighed
    (``options``, smallest first): the estimated throughput of the tier holding it (``link_bps``, bytes/s) and its
    decode rate (``decode_tps``, tokens/s; a variant never decoded here has the prior, 1e12); ``slowdown``: how many
    times longer the largest one's reads take beside a small decode (:class:`~kvcodec.store.telemetry.Contention`;
    inf in the process's first load: :meth:`LoadPlanner.slowdown`);
    ``recompute_tps``: the engine's prefill speed, or None."""

    rule: str
    variant: int | None
    options: tuple[Option, ...]
    link_bps: tuple[float, ...]
    decode_tps: tuple[float, ...]
    slowdown: float
    recompute_tps: float | None


class LoadPlanner:
    """The estimates of one load of chunks stored in ``variants`` (see the module doc), from ``telemetry``.
    ``recompute_tps``: the engine's prefill speed, or None (never stop early).  ``first``: the process's first
    load, whose small decodes are planned as taking the link's whole time while they run (:meth:`slowdown`)."""

    def __init__(self, telemetry: Telemetry, variants: Sequence[Codec], *,
                 recompute_tps: float | None = None, first: bool = False) -> None:
        if recompute_tps is not None and not recompute_tps > 0:
            raise InvalidInputError(f"recompute_tps must be positive, not {recompute_tps!r}")
        self.telemetry, self.variants, self.recompute_tps = telemetry, list(variants), recompute_tps
        self.first = first

    def fetch_s(self, option: Option, nbytes: int | None = None) -> float:
        """Seconds to read ``nbytes`` (default: all) of ``option`` from its tier."""
        return (option.nbytes if nbytes is None else nbytes) / self.telemetry.link(option.tier).throughput.estimate

    def decode_s(self, option: Option, tokens: int) -> float:
        """Seconds to decode a ``tokens``-token chunk in ``option`` (0 for a variant this store never decoded)."""
        return tokens / self.telemetry.decode_rate(self.variants[option.variant]).estimate

    def decode_known(self, option: Option) -> bool:
        """Whether :meth:`decode_s` comes from this store's own decodes of that variant."""
        return bool(self.telemetry.decode_rate(self.variants[option.variant]).samples)

    def small_pays(self, small: Option, large: Option, tokens: int) -> bool:
        """Whether decoding a chunk's small variant saves the link more time (its large variant's read) than the
        decode costs the link by slowing it (:class:`~kvcodec.store.telemetry.Contention`)."""
        return self.fetch_s(large) > self.decode_s(small, tokens) * (1 - 1 / self.slowdown(large))

    def slowdown(self, option: Option) -> float:
        """How many times longer reads of ``option``'s tier take beside a small variant's decode, at its speed now;
        unbounded (a decode stops the link) in the process's first load.

        A fresh engine's first request shares the cores with the engine's own first step, and no measurement of
        another process describes it: inside vLLM over an unshaped or 10 Gbit/s link a first load's kvtc decode
        took 0.44-0.59 s against 0.16-0.18 s planned and raw reads beside it were 5-14x slower, while the pairs
        its predecessors had measured said 1.04 (docs/adaptation.md).  So a first load decodes a small variant beside large reads only where that pays even if the link stood
        still meanwhile: on a slow link, where the small variants matter most, it still does."""
        if self.first:
            return math.inf
        link = self.telemetry.link(option.tier)
        return link.contention.slowdown(link.throughput.estimate)

    def decide(self, rule: str, variant: int | None, options: Sequence[Option]) -> Decision:
        """A :class:`Decision` by ``rule`` for ``variant`` among ``options`` (smallest first), estimated now."""
        return Decision(rule, variant, tuple(options),
                        tuple(self.telemetry.link(o.tier).throughput.estimate for o in options),
                        tuple(self.telemetry.decode_rate(self.variants[o.variant]).estimate for o in options),
                        self.slowdown(options[-1]), self.recompute_tps)

    def describe(self, decision: Decision) -> str:
        """One line: the variant chosen, the rule, and each variant weighed with its estimates."""
        chosen = "recompute" if decision.variant is None else self.variants[decision.variant].codec_id
        weighed = ", ".join(f"{self.variants[o.variant].codec_id} {o.nbytes} B on {o.tier} at {bps / 1e6:.3g} MB/s, "
                            f"decode {tps:.3g} tokens/s"
                            for o, bps, tps in zip(decision.options, decision.link_bps, decision.decode_tps))
        recompute = "" if decision.recompute_tps is None else f", recompute {decision.recompute_tps:.3g} tokens/s"
        return f"{chosen} ({decision.rule}): {weighed}; slowdown beside a decode {decision.slowdown:.2f}{recompute}"

    def worth_loading(self, small: Option, large: Option | None, tokens: int, remaining_tokens: int,
                      backlog_s: float = 0.0, *, free_link: bool = False) -> bool:
        """Whether loading ``remaining_tokens`` more tokens (chunks of ``tokens``, in ``small`` and ``large``) ends
        sooner than the engine recomputing them, with ``backlog_s`` seconds of decoding already queued; with
        ``free_link``, were fetching free (whether the link's estimate can matter at all)."""
        if self.recompute_tps is None:
            return True
        stages = [(0.0 if free_link else self.fetch_s(o), self.decode_s(o, tokens))
                  for o in (small, large) if o is not None]
        load_s = finish_s(0.0, backlog_s, max(0, remaining_tokens) / tokens, stages)
        return load_s <= backlog_s + remaining_tokens / self.recompute_tps


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
