"""Bandwidth adaptation for multi-level containers (CacheGen, SIGCOMM 2024, §5.3).

A multi-level container stores every chunk at several levels ("variants",
ordered smallest to best).  Chunks are streamed in order over one link.  Before
each chunk is sent, a policy looks at the throughput measured on the chunks
already sent and at the time left until the deadline, and picks the best level
that still lets the rest of the stream finish in time; when even the smallest
level would arrive later than recomputing the chunk from its token ids, it
answers :data:`RECOMPUTE` (only the token ids cross the link, and the chunk's
KV is recomputed by prefill).

Pieces:

* :class:`~kvcodec.store.telemetry.RateEstimator` (the store's own): harmonic
  mean of the last ``window`` chunk throughputs, a prior before any observation.
* :class:`ChunkTable`: bytes of every chunk at every level, from a
  :class:`kvcodec.Reader` or from plain size lists.
* :class:`AdaptationPolicy` (``decide(i, now_s, estimate)``) and the fixed
  baselines :meth:`AdaptationPolicy.fixed` and :meth:`AdaptationPolicy.recompute_all`.
* :class:`BandwidthTrace` and :func:`simulate`: a deterministic fetch simulator.
* :func:`fetch`: read the chosen level of every chunk from a real container.

The model of time used by :func:`simulate` (and assumed by the policy):

* One link, chunks sent back to back in chunk order; sending ``N`` bytes from
  time ``t`` integrates the piecewise-constant trace.  No latency per transfer.
  A RECOMPUTE chunk sends only its token ids (the policy's ``token_id_bytes``
  per token).
* One compute device, which decodes received chunks and recomputes RECOMPUTE
  chunks, one chunk at a time in chunk order.  It runs in parallel with the
  link: while chunk ``i`` is recomputed, chunks ``i+1, ...`` keep arriving.
* Recomputing chunk ``i`` is a prefix-causal prefill: it starts only once the KV
  of every chunk ``< i`` is ready (received and decoded, or recomputed).
* ``ready[i]`` is when the KV of chunks ``0..i`` is all usable;
  time-to-first-token (TTFT) is ``ready`` of the last chunk.  The prefill of
  the new query after the context is the same for every strategy and left out,
  as is fetching the container's header and index.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvcodec.errors import InvalidInputError
from kvcodec.store.telemetry import LINK_PRIOR_BPS, RateEstimator

if TYPE_CHECKING:
    from kvcodec.cache import KVCache
    from kvcodec.reader import Reader

#: Bytes sent per token id for a recomputed chunk (int32 ids).
TOKEN_ID_BYTES = 4

_REL_TOL = 1e-9  # float slack on deadline comparisons


def _fits(t: float, deadline: float) -> bool:
    return t <= deadline + _REL_TOL * max(1.0, abs(deadline))


# --------------------------------------------------------------------------------------------- chunk sizes

@dataclass(frozen=True)
class ChunkTable:
    """Bytes of every chunk at every level: ``sizes[chunk][level]``, levels smallest to best.

    A chunk is a token block (all layer groups of it together, in stream order).
    ``elements`` (KV elements per chunk) is optional and only used to report bits
    per element.
    """

    sizes: tuple[tuple[int, ...], ...]
    token_starts: tuple[int, ...]
    token_counts: tuple[int, ...]
    elements: tuple[int, ...] | None = None
    level_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.sizes)
        if n == 0:
            raise InvalidInputError("a chunk table needs at least one chunk")
        levels = len(self.sizes[0])
        if levels == 0 or any(len(row) != levels for row in self.sizes):
            raise InvalidInputError("every chunk needs a size for every level (and at least one level)")
        if any(not (isinstance(s, int) and s > 0) for row in self.sizes for s in row):
            raise InvalidInputError("chunk sizes must be positive integers (bytes)")
        if len(self.token_starts) != n or len(self.token_counts) != n:
            raise InvalidInputError("token_starts and token_counts need one entry per chunk")
        if any(c <= 0 for c in self.token_counts):
            raise InvalidInputError("every chunk needs a positive token count")
        if any(a + c != b for a, c, b in zip(self.token_starts, self.token_counts, self.token_starts[1:])):
            raise InvalidInputError("chunks must cover one contiguous token range in order")
        if self.elements is not None and len(self.elements) != n:
            raise InvalidInputError("elements needs one entry per chunk")
        if self.level_names and len(self.level_names) != levels:
            raise InvalidInputError(f"{len(self.level_names)} level names for {levels} levels")
        if not self.level_names:
            object.__setattr__(self, "level_names", tuple(f"L{k}" for k in range(levels)))

    @property
    def num_chunks(self) -> int:
        return len(self.sizes)

    @property
    def num_levels(self) -> int:
        return len(self.sizes[0])

    def level_bytes(self, level: int) -> int:
        """Bytes of the whole stream at one level."""
        return sum(row[level] for row in self.sizes)

    @classmethod
    def from_sizes(cls, sizes: Sequence[Sequence[int]], chunk_tokens: int = 256, *,
                   token_counts: Sequence[int] | None = None, elements: Sequence[int] | None = None,
                   level_names: Sequence[str] = ()) -> ChunkTable:
        """From plain sizes ``sizes[chunk][level]``; every chunk holds ``chunk_tokens`` tokens unless
        ``token_counts`` says otherwise."""
        counts = list(token_counts) if token_counts is not None else [chunk_tokens] * len(sizes)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return cls(tuple(tuple(int(s) for s in row) for row in sizes), tuple(starts), tuple(counts),
                   None if elements is None else tuple(int(e) for e in elements), tuple(level_names))

    @classmethod
    def from_reader(cls, reader: Reader) -> ChunkTable:
        """From a container's index: frame lengths per token block per variant.

        Every token block must hold every variant in every layer group (what
        :func:`kvcodec.encode` writes for a list of codecs).
        """
        header = reader.header
        levels = len(header.variants)
        groups = header.layer_groups
        blocks: dict[int, dict[int, list[Any]]] = {}
        for e in reader.chunks:
            blocks.setdefault(e.token_start, {}).setdefault(e.variant, []).append(e)
        sizes, starts, counts, elements = [], [], [], []
        for t0 in sorted(blocks):
            by_level = blocks[t0]
            row = []
            for v in range(levels):
                entries = by_level.get(v, [])
                if len(entries) != groups:
                    raise InvalidInputError(f"the chunk at token {t0} is not stored at level {v} in every layer group; "
                                            "adaptation needs every chunk at every level")
                row.append(sum(e.length for e in entries))
            first = by_level[0][0]
            sizes.append(tuple(row))
            starts.append(t0)
            counts.append(first.token_count)
            n = 0
            for layer, s in enumerate(header.layers):
                lo, hi = header.local_range(layer, t0, first.token_count)
                n += s.heads * (hi - lo) * (s.key_dim + s.value_dim)
            elements.append(n)
        names = tuple(_variant_name(v.codec, v.config) for v in header.variants)
        return cls(tuple(sizes), tuple(starts), tuple(counts), tuple(elements), names)

    def scaled(self, factor: float) -> ChunkTable:
        """Every size (and element count) times ``factor``: the same bits per element on a bigger model."""
        if not factor > 0:
            raise InvalidInputError(f"scale factor must be positive, not {factor!r}")
        sizes = tuple(tuple(max(1, round(s * factor)) for s in row) for row in self.sizes)
        elements = None if self.elements is None else tuple(round(e * factor) for e in self.elements)
        return ChunkTable(sizes, self.token_starts, self.token_counts, elements, self.level_names)

    def tiled(self, num_chunks: int) -> ChunkTable:
        """``num_chunks`` chunks whose sizes repeat this table's chunks cyclically (a longer context)."""
        if num_chunks < 1:
            raise InvalidInputError("tiled needs at least one chunk")
        idx = [i % self.num_chunks for i in range(num_chunks)]
        counts = [self.token_counts[i] for i in idx]
        return ChunkTable.from_sizes([self.sizes[i] for i in idx], token_counts=counts,
                                     elements=None if self.elements is None else [self.elements[i] for i in idx],
                                     level_names=self.level_names)


def _variant_name(codec: str, config: dict[str, Any]) -> str:
    opts = ",".join(f"{k}={v}" for k, v in sorted(config.items()) if not isinstance(v, (list, dict)))
    return f"{codec}:{opts}" if opts else codec


def as_table(chunks: ChunkTable | Reader | Sequence[Sequence[int]]) -> ChunkTable:
    if isinstance(chunks, ChunkTable):
        return chunks
    if hasattr(chunks, "chunks") and hasattr(chunks, "header"):
        return ChunkTable.from_reader(chunks)  # type: ignore[arg-type]
    return ChunkTable.from_sizes(chunks)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- policy

@dataclass(frozen=True)
class Decision:
    """What to do with one chunk: fetch level ``level`` (0 = smallest), or recompute it (``level == -1``).

    ``reason`` is for people and does not take part in comparisons.
    """

    level: int
    reason: str = field(default="", compare=False)

    @property
    def recompute(self) -> bool:
        return self.level < 0

    def __str__(self) -> str:
        return "recompute" if self.recompute else f"level {self.level}"


#: Send the chunk's token ids and recompute its KV.
RECOMPUTE = Decision(-1)


class AdaptationPolicy:
    """CacheGen's adaptation: recompute when that beats even the smallest level, else the best level that
    fits the remaining budget, else the smallest.

    ``chunks``: a :class:`ChunkTable`, a :class:`kvcodec.Reader` of a multi-level
    container, or plain sizes ``sizes[chunk][level]`` in bytes.
    ``time_budget_s``: the deadline for all KV to be ready, from the start of the stream.
    ``recompute_s``: seconds to recompute one chunk, or a callable
    ``(token_start, token_count) -> seconds`` (a prefill's cost grows with its prefix).
    ``decode_s_per_byte``: compute time to decode a received chunk, per byte.
    ``token_id_bytes``: bytes per token sent for a recomputed chunk.
    ``safety``: the policy plans with ``safety x estimate`` (1: CacheGen's rule as
    is, which spends the whole budget and so overshoots it about as often as
    the throughput falls below its estimate; 0.8 trades some quality for
    meeting the budget on jittery links).

    :meth:`decide` for chunk ``i`` at time ``now_s`` with throughput ``estimate``:

    1. RECOMPUTE if recomputing chunk ``i`` would finish before even its smallest
       level would arrive (and be decoded).  Recompute starts when the chunk's
       token ids have arrived and at ``compute_ready_s`` at the earliest: the
       compute device must be free and the prefix ready (the simulator passes
       when chunks ``< i`` are ready; ``None`` means now).
    2. Otherwise the highest level ``L`` such that sending chunk ``i`` *and every
       remaining chunk* at level ``L`` is expected to end by the deadline.  The
       remaining budget is thus shared among the remaining chunks in proportion
       to their sizes, as if the current throughput held and the rest of the
       stream stayed at one level (CacheGen's rule).  On a constant link, with
       an exact estimate and no decode time, it never picks a level it must
       later go below, so levels only rise and the budget is met whenever the
       smallest level fits it.
    3. Otherwise (nothing fits) the smallest level.
    """

    name = "adaptive"

    def __init__(self, chunks: ChunkTable | Reader | Sequence[Sequence[int]], time_budget_s: float,
                 recompute_s: float | Callable[[int, int], float], *, decode_s_per_byte: float = 0.0,
                 token_id_bytes: int = TOKEN_ID_BYTES, safety: float = 1.0) -> None:
        self.table = as_table(chunks)
        if not (0 < safety <= 1):
            raise InvalidInputError(f"safety must be in (0, 1], not {safety!r}")
        self.safety = float(safety)
        if safety != 1.0:
            self.name = f"adaptive (plans with {safety:g} x estimate)"
        if not (isinstance(token_id_bytes, int) and token_id_bytes >= 0):
            raise InvalidInputError(f"token_id_bytes must be a non-negative integer, not {token_id_bytes!r}")
        self.token_id_bytes = token_id_bytes
        if not (time_budget_s > 0 and math.isfinite(time_budget_s)):
            raise InvalidInputError(f"time_budget_s must be a positive number, not {time_budget_s!r}")
        if decode_s_per_byte < 0:
            raise InvalidInputError("decode_s_per_byte must not be negative")
        if not callable(recompute_s) and not (recompute_s > 0 and math.isfinite(recompute_s)):
            raise InvalidInputError(f"recompute_s must be a positive number or a callable, not {recompute_s!r}")
        self.budget_s = float(time_budget_s)
        self.decode_s_per_byte = float(decode_s_per_byte)
        self._recompute_arg = recompute_s
        t = self.table
        self._recompute = tuple(
            float(recompute_s(t.token_starts[i], t.token_counts[i]) if callable(recompute_s) else recompute_s)
            for i in range(t.num_chunks))
        if any(not (c >= 0 and math.isfinite(c)) for c in self._recompute):
            raise InvalidInputError("recompute costs must be finite and non-negative")
        # suffix[level][i]: bytes of chunks i.. at that level
        self._suffix = []
        for level in range(t.num_levels):
            acc, suf = 0, [0] * (t.num_chunks + 1)
            for i in range(t.num_chunks - 1, -1, -1):
                acc += t.sizes[i][level]
                suf[i] = acc
            self._suffix.append(suf)

    # cost model ---------------------------------------------------------------------------------

    def recompute_cost(self, i: int) -> float:
        """Seconds to recompute chunk ``i`` (its prefix already in place)."""
        return self._recompute[i]

    def remaining_s(self, i: int, level: int, estimate: float) -> float:
        """Expected seconds from now until chunks ``i..`` are all received and decoded at ``level``.

        A two-stage pipeline (link, then decode): at least the whole transfer plus
        the last chunk's decode, and at least the first transfer plus every decode.
        """
        t = self.table
        sizes = self._suffix[level]
        transfer = sizes[i] / estimate
        dec = self.decode_s_per_byte
        return max(transfer + dec * t.sizes[-1][level], t.sizes[i][level] / estimate + dec * sizes[i])

    def decide(self, i: int, now_s: float, estimate: float, *, compute_ready_s: float | None = None) -> Decision:
        """The level for chunk ``i`` whose transfer would start at ``now_s``, given ``estimate`` bytes/s."""
        if not 0 <= i < self.table.num_chunks:
            raise InvalidInputError(f"chunk {i} does not exist; there are {self.table.num_chunks}")
        if not (estimate > 0 and math.isfinite(estimate)):
            raise InvalidInputError(f"the bandwidth estimate must be a positive number, not {estimate!r}")
        estimate *= self.safety
        smallest = self.table.sizes[i][0]
        kv_ready = now_s + smallest / estimate + self.decode_s_per_byte * smallest
        ids_arrive = now_s + self.token_id_bytes * self.table.token_counts[i] / estimate
        start = ids_arrive if compute_ready_s is None else max(ids_arrive, compute_ready_s)
        if start + self.recompute_cost(i) < kv_ready:
            return Decision(-1, f"recompute ({self.recompute_cost(i):.4g} s) beats the smallest level "
                                f"({kv_ready - now_s:.4g} s)")
        for level in range(self.table.num_levels - 1, -1, -1):
            if _fits(now_s + self.remaining_s(i, level, estimate), self.budget_s):
                return Decision(level, "fits the remaining budget")
        return Decision(0, "nothing fits the remaining budget; smallest level")

    # baselines ----------------------------------------------------------------------------------

    def fixed(self, level: int) -> FixedPolicy:
        """A baseline that always fetches ``level``, with this policy's costs and budget."""
        if not 0 <= level < self.table.num_levels:
            raise InvalidInputError(f"level {level} does not exist; there are {self.table.num_levels}")
        return FixedPolicy(self, Decision(level, "fixed"), f"always {self.table.level_names[level]}")

    def recompute_all(self) -> FixedPolicy:
        """A baseline that recomputes every chunk (sends only token ids)."""
        return FixedPolicy(self, Decision(-1, "fixed"), "recompute all")


class FixedPolicy(AdaptationPolicy):
    """Always the same decision; costs and budget from another policy."""

    def __init__(self, base: AdaptationPolicy, decision: Decision, name: str) -> None:
        super().__init__(base.table, base.budget_s, base._recompute_arg, decode_s_per_byte=base.decode_s_per_byte,
                         token_id_bytes=base.token_id_bytes, safety=base.safety)
        self.decision = decision
        self.name = name

    def decide(self, i: int, now_s: float, estimate: float, *, compute_ready_s: float | None = None) -> Decision:
        return self.decision


# --------------------------------------------------------------------------------------------- traces

class BandwidthTrace:
    """Piecewise-constant link bandwidth: ``segments`` of ``(start_s, bytes_per_s)``.

    The first segment starts at 0; starts strictly increase; the last segment
    lasts forever and must have a positive rate (earlier ones may be 0, an outage).
    """

    def __init__(self, segments: Sequence[tuple[float, float]], name: str = "trace") -> None:
        segs = [(float(t), float(r)) for t, r in segments]
        if not segs or segs[0][0] != 0.0:
            raise InvalidInputError("a trace's first segment must start at 0")
        if any(b[0] <= a[0] for a, b in zip(segs, segs[1:])):
            raise InvalidInputError("trace segment starts must strictly increase")
        if any(r < 0 or not math.isfinite(r) for _, r in segs) or segs[-1][1] <= 0:
            raise InvalidInputError("trace rates must be finite and non-negative, the last one positive")
        self.segments = tuple(segs)
        self.name = name

    @classmethod
    def steady(cls, bytes_per_s: float, name: str = "steady") -> BandwidthTrace:
        return cls([(0.0, bytes_per_s)], name)

    @classmethod
    def from_rates(cls, rates: Sequence[float], interval_s: float, name: str = "trace") -> BandwidthTrace:
        """``rates[k]`` bytes/s during ``[k*interval_s, (k+1)*interval_s)``; the last rate holds after."""
        return cls([(k * interval_s, r) for k, r in enumerate(rates)], name)

    @classmethod
    def jittery(cls, mean_bps: float, duration_s: float, interval_s: float, *, sigma: float = 0.5, seed: int = 0,
                name: str = "jittery") -> BandwidthTrace:
        """Log-normal rates (mean ``mean_bps``, log-std ``sigma``), a new one every ``interval_s``, from ``seed``."""
        rng = random.Random(seed)
        n = max(1, math.ceil(duration_s / interval_s))
        rates = [mean_bps * math.exp(sigma * rng.gauss(0.0, 1.0) - sigma * sigma / 2) for _ in range(n)]
        return cls.from_rates(rates, interval_s, name)

    def rate_at(self, t: float) -> float:
        rate = self.segments[0][1]
        for start, r in self.segments:
            if start > t:
                break
            rate = r
        return rate

    def mean_rate(self, t0: float, t1: float) -> float:
        """Average bytes/s over ``[t0, t1)``."""
        if t1 <= t0:
            return self.rate_at(t0)
        total = 0.0
        for k, (start, r) in enumerate(self.segments):
            end = self.segments[k + 1][0] if k + 1 < len(self.segments) else math.inf
            lo, hi = max(start, t0), min(end, t1)
            if hi > lo:
                total += r * (hi - lo)
        return total / (t1 - t0)

    def transfer_end(self, start_s: float, nbytes: float) -> float:
        """When ``nbytes`` bytes sent from ``start_s`` have all arrived."""
        if nbytes <= 0:
            return start_s
        t, left = start_s, float(nbytes)
        for k, (start, r) in enumerate(self.segments):
            end = self.segments[k + 1][0] if k + 1 < len(self.segments) else math.inf
            if end <= t:
                continue
            if r > 0:
                if end == math.inf or left <= r * (end - t):
                    return t + left / r
                left -= r * (end - t)
            t = end
        raise AssertionError("unreachable: the last segment has a positive rate")


# --------------------------------------------------------------------------------------------- simulator

@dataclass(frozen=True)
class ChunkRecord:
    """One chunk in a simulated fetch."""

    index: int
    decision: Decision
    estimate_bps: float  # the throughput estimate the decision was made with
    start_s: float       # its transfer began
    arrival_s: float     # its bytes (or token ids) had all arrived
    ready_s: float       # the KV of chunks 0..index was all usable
    nbytes: int          # bytes sent


@dataclass
class SimResult:
    """A simulated fetch: one :class:`ChunkRecord` per chunk and the time-to-first-token."""

    policy: str
    trace: str
    budget_s: float
    records: list[ChunkRecord]
    table: ChunkTable = field(repr=False)

    @property
    def ttft_s(self) -> float:
        return self.records[-1].ready_s

    @property
    def met_budget(self) -> bool:
        return _fits(self.ttft_s, self.budget_s)

    @property
    def decisions(self) -> list[Decision]:
        return [r.decision for r in self.records]

    @property
    def levels(self) -> list[int]:
        """Level per chunk; -1 for recompute."""
        return [r.decision.level for r in self.records]

    @property
    def arrivals(self) -> list[float]:
        return [r.arrival_s for r in self.records]

    @property
    def bytes_sent(self) -> int:
        return sum(r.nbytes for r in self.records)

    @property
    def histogram(self) -> dict[str, int]:
        """Chunks per level name (and ``recompute``), in level order."""
        counts = Counter(self.levels)
        out = {name: counts[k] for k, name in enumerate(self.table.level_names) if counts[k]}
        if counts[-1]:
            out["recompute"] = counts[-1]
        return out

    @property
    def bits_per_element(self) -> float:
        """Bits per KV element over the chunks sent as KV (recomputed chunks left out); NaN if none or unknown."""
        if self.table.elements is None:
            return math.nan
        kv = [r for r in self.records if not r.decision.recompute]
        elements = sum(self.table.elements[r.index] for r in kv)
        return 8 * sum(r.nbytes for r in kv) / elements if elements else math.nan

    def level_string(self) -> str:
        """One character per chunk: the level digit, or ``R`` for recompute."""
        return "".join("R" if lv < 0 else (str(lv) if lv < 10 else "+") for lv in self.levels)


def simulate(policy: AdaptationPolicy, trace: BandwidthTrace,
             estimator: RateEstimator | None = None) -> SimResult:
    """Fetch every chunk of ``policy.table`` over ``trace`` as ``policy`` decides (see the module's model of time).

    ``estimator`` (default: a fresh :class:`RateEstimator`) sees every
    transfer, token ids of recomputed chunks included, after it ends and before
    the next decision.  Deterministic: same inputs, same result.
    """
    est = estimator if estimator is not None else RateEstimator(LINK_PRIOR_BPS)
    table = policy.table
    link = 0.0   # the link is free from here
    ready = 0.0  # the KV of every chunk decided so far is usable from here (the compute device is free)
    records = []
    for i in range(table.num_chunks):
        now, estimate = link, est.estimate
        d = policy.decide(i, now, estimate, compute_ready_s=ready)
        if d.recompute:
            nbytes = policy.token_id_bytes * table.token_counts[i]
        elif 0 <= d.level < table.num_levels:
            nbytes = table.sizes[i][d.level]
        else:
            raise InvalidInputError(f"policy {policy.name} chose level {d.level} of {table.num_levels}")
        end = trace.transfer_end(now, nbytes)
        est.observe(nbytes, end - now)
        work = policy.recompute_cost(i) if d.recompute else policy.decode_s_per_byte * nbytes
        ready = max(end, ready) + work
        link = end
        records.append(ChunkRecord(i, d, estimate, now, end, ready, nbytes))
    return SimResult(policy.name, trace.name, policy.budget_s, records, table)


def compare(policy: AdaptationPolicy, trace: BandwidthTrace,
            estimator: Callable[[], RateEstimator] = RateEstimator, *,
            others: Sequence[AdaptationPolicy] = ()) -> list[SimResult]:
    """``policy``, ``others``, every fixed level of ``policy``, then recompute-all, each simulated on
    ``trace`` with a fresh estimator."""
    strategies = [policy, *others] + [policy.fixed(k) for k in range(policy.table.num_levels)]
    strategies.append(policy.recompute_all())
    return [simulate(s, trace, estimator()) for s in strategies]


# --------------------------------------------------------------------------------------------- real fetch

@dataclass
class Fetched:
    """What :func:`fetch` read: decoded token ranges, and the ranges left to recompute."""

    pieces: list[tuple[int, int, KVCache]]  # (token_start, token_end, the cache of those tokens)
    missing: list[tuple[int, int]]          # (token_start, token_count) to recompute, adjacent ones merged
    nbytes: int                             # frame bytes read

    @property
    def kv(self) -> KVCache:
        """The whole cache, when nothing is missing."""
        if self.missing or len(self.pieces) != 1:
            raise InvalidInputError(f"tokens {self.missing} are missing; recompute them or use .pieces")
        return self.pieces[0][2]


def fetch(reader: Reader, decisions: Sequence[Decision | int], *, device: Any = None) -> Fetched:
    """Decode chunk ``i`` of ``reader`` at level ``decisions[i]`` (only that variant is read).

    Runs of fetched chunks come back as caches of their token ranges; RECOMPUTE
    chunks (or level -1) as missing token ranges.
    """
    table = ChunkTable.from_reader(reader)
    if len(decisions) != table.num_chunks:
        raise InvalidInputError(f"{len(decisions)} decisions for {table.num_chunks} chunks")
    levels = [d.level if isinstance(d, Decision) else int(d) for d in decisions]
    if any(lv >= table.num_levels or lv < -1 for lv in levels):
        raise InvalidInputError(f"levels must be -1 (recompute) or below {table.num_levels}")
    by_cell: dict[tuple[int, int], list[int]] = {}
    for idx, e in enumerate(reader.chunks):
        by_cell.setdefault((e.token_start, e.variant), []).append(idx)
    pieces: list[tuple[int, int, Any]] = []
    missing: list[tuple[int, int]] = []
    nbytes = 0
    run: list[int] = []
    run_start = 0
    entries = reader.chunks

    def flush(end: int) -> None:
        if run:
            pieces.append((run_start, end, reader.decode(chunks=list(run), device=device)))
            run.clear()

    for i, lv in enumerate(levels):
        t0, tn = table.token_starts[i], table.token_counts[i]
        if lv < 0:
            flush(t0)
            if missing and sum(missing[-1]) == t0:
                missing[-1] = (missing[-1][0], missing[-1][1] + tn)
            else:
                missing.append((t0, tn))
            continue
        if not run:
            run_start = t0
        idx = by_cell[(t0, lv)]
        run.extend(idx)
        nbytes += sum(entries[j].length for j in idx)
    flush(table.token_starts[-1] + table.token_counts[-1])
    return Fetched(pieces, missing, nbytes)
