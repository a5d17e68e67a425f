"""Adaptation at load time: which stored variant of each chunk to fetch, or where to stop loading and let the engine
recompute the rest.

A store may keep each chunk in several variants (``KVStore(codec=["kvtc:level=0", "cachegen", "raw"])``, smallest
first; every variant must meet the deployment's quality floor).  A load streams chunks, fetch overlapping decode,
so a chunk's cost is the slower of the two: its bytes over the estimated throughput of the tier holding it
(:attr:`KVStore.links`, from the store's own recent reads: the harmonic mean of the last few, which drops at once
when the link does) and its tokens at the variant's decode rate (:meth:`KVStore.decode_rate`, from the store's own
recent decodes).  Before a chunk is fetched the planner takes the variant that costs least, or the best (latest
listed) of those within ``slack`` of it, and compares loading the rest of the prompt at that cost with the engine
recomputing it at ``recompute_tps`` (tokens per second of prefill the engine hook observed): when recomputing is
sooner, the load stops there.  Without ``recompute_tps`` it never stops.  It decides again before every chunk, so
a link that slows down in the middle of a request moves the rest of it to smaller variants, or to recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvcodec.errors import InvalidInputError

if TYPE_CHECKING:
    from kvcodec.store.store import KVStore

DEFAULT_SLACK = 0.05


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

    def cost_s(self, option: Option, tokens: int) -> float:
        """Seconds to load one chunk of ``tokens`` tokens in ``option``: the slower of fetch and decode."""
        fetch = option.nbytes / self.store.links[option.tier].estimate
        decode = tokens / self.store.decode_rate(self.variants[option.variant]).estimate
        return max(fetch, decode)

    def choose(self, options: Sequence[Option], tokens: int, remaining_tokens: int) -> Option | None:
        """The option to fetch for a chunk of ``tokens`` tokens with ``remaining_tokens`` (this chunk's included)
        still to load, or None to stop and recompute them."""
        if not options:
            return None
        costs = {o: self.cost_s(o, tokens) for o in options}
        fastest = min(costs.values())
        pick = max((o for o in options if costs[o] <= fastest * (1 + self.slack)), key=lambda o: o.variant)
        if self.recompute_tps is not None and fastest * remaining_tokens / tokens > remaining_tokens / self.recompute_tps:
            return None
        return pick
