"""What a store has measured of its own loads: each tier's link (throughput, and how much a decode beside a read
slows it) and each codec variant's decode rate.  The load planner (:mod:`kvcodec.store.plan`) plans with these;
loads (:mod:`kvcodec.store.load`) feed them.  :meth:`Telemetry.estimates` and :meth:`Telemetry.restore` carry them
from one process to the next (:mod:`kvcodec.store.telemetry_file` keeps them in a file).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from kvcodec.errors import InvalidInputError

#: Samples a :class:`RateEstimator` averages.
DEFAULT_WINDOW = 3
#: A link's throughput before any read was measured: 1 Gbit/s, in bytes per second.
LINK_PRIOR_BPS = 1e9 / 8
# A link's throughput estimate starts over from a read that is this many times faster than it (a change of regime,
# not noise: on loopback a read beside a decode took up to 2.7x as long, bench/load_overlap.py), so a rise is seen
# within one read as a drop is.  Plain harmonic mean: three reads at 20 Mbit/s and one at 10 Gbit/s still estimate
# 27 Mbit/s, and a load that reads 64 KiB pieces to probe (kvcodec.store.load) would never see the rise.  A read this
# many times slower restarts it only once the next read confirms it: the harmonic mean already takes most of a drop
# from one read (three at 1 Gbit/s and one at 20 Mbit/s: 26 Mbit/s), while one stalled read on a cold engine's
# contended cores (one 2.6 MB piece in 32 ms among pieces at 200-800 MB/s, inside vLLM unshaped) restarted the
# estimate at 82 MB/s and made a fresh engine's first load decode kvtc where raw was sooner.
LINK_FOLLOW = 4.0
# A read this short that looks slower than the link's estimate does not lower it: its time is mostly the
# request's round trip, not the link.  Inside vLLM here a 230 KB Redis GET took 4.9 ms on an unshaped link of about
# 600 MB/s, which read as 47 MB/s and made a fresh engine's first load, once kvtc's decode was timed at start, take
# kvtc for half its chunks (0.86-0.99 s against raw's 0.26 s).  A slower link shows in a longer read: a 256 KiB
# piece takes 21 ms at 100 Mbit/s, a 32 KiB probe piece 13 ms at 20 Mbit/s.  (Counting short reads together until
# they added up to this long was tried: inside vLLM a fresh engine's first two reads, 5.7 and 6.5 ms on a cold
# connection, then gave 40 MB/s on a link whose next pieces came at 500 MB/s.)
ROUND_TRIP_S = 0.010
# An unmeasured codec is taken to decode for free (tokens per second), so that the first load that could use it
# does, and measures it.
DECODE_PRIOR_TPS = 1e12


class RateEstimator:
    """A rate (an amount per second: bytes, tokens) as the harmonic mean of the last ``window`` measurements, and
    ``prior`` before the first.

    Why a windowed harmonic mean (the estimator of ABR video players such as MPC, Yin et al. SIGCOMM 2015) rather
    than an exponentially weighted mean: a planner predicts *times* (amount / rate), and the harmonic mean of rates
    is the rate that gives the mean time per unit (for equal amounts exactly total amount / total time); it is
    dominated by the low samples, so one slow measurement pulls the estimate down at once (a deadline is missed by
    overestimating), while it climbs back only as fast samples fill the window; and a window forgets a regime after
    exactly ``window`` samples, which keeps behaviour easy to predict and test.  Measurements of nothing or of no
    time carry no rate and are ignored.  With ``follow``, a measurement more than ``follow`` times above the
    estimate starts the window over, and so do two in a row more than ``follow`` times below the estimate before
    the first: the estimate follows a change of regime both ways (a fall mostly within one sample, through the
    harmonic mean, and wholly within two), and one slow outlier is averaged.
    """

    def __init__(self, prior: float, window: int = DEFAULT_WINDOW, *, follow: float | None = None) -> None:
        if not (isinstance(window, int) and window >= 1):
            raise InvalidInputError(f"window must be a positive integer, not {window!r}")
        if not (prior > 0 and math.isfinite(prior)):
            raise InvalidInputError(f"prior must be a positive number, not {prior!r}")
        if follow is not None and not follow > 1:
            raise InvalidInputError(f"follow must be above 1, not {follow!r}")
        self.prior, self.window, self.follow = float(prior), window, follow
        self._samples: deque[float] = deque(maxlen=window)
        self._fell_from: float | None = None  # the estimate before the latest sample, where that sample fell below it
        self.measured_at: float | None = None  # the wall-clock time (time.time()) of the latest sample

    def observe(self, amount: float, seconds: float) -> None:
        """Record ``amount`` done in ``seconds``."""
        if amount < 0 or seconds < 0 or not (math.isfinite(amount) and math.isfinite(seconds)):
            raise InvalidInputError(f"a measurement needs a finite non-negative amount and time, not {amount}, "
                                    f"{seconds}")
        if amount == 0 or seconds == 0:
            return
        rate = amount / seconds
        if self.follow is not None and self._samples:
            estimate, fell_from, self._fell_from = self.estimate, self._fell_from, None
            if rate > estimate * self.follow:
                self._samples.clear()
            elif fell_from is not None and rate < fell_from / self.follow:
                fell = self._samples[-1]
                self._samples.clear()
                self._samples.append(fell)
            elif rate < estimate / self.follow:
                self._fell_from = estimate
        self._samples.append(rate)
        self.measured_at = time.time()

    def seed(self, rate: float, measured_at: float) -> None:
        """Take ``rate``, measured at ``measured_at`` (an earlier process's estimate), as a sample: the next
        ``window`` measurements push it out."""
        self._samples.append(float(rate))
        self.measured_at = measured_at

    @property
    def samples(self) -> tuple[float, ...]:
        """The rates in the window, oldest first."""
        return tuple(self._samples)

    @property
    def estimate(self) -> float:
        """The harmonic mean of the window, or the prior before any measurement."""
        samples = self.samples  # a copy: another thread may be observing
        if not samples:
            return self.prior
        return len(samples) / sum(1.0 / s for s in samples)


class Contention:
    """How much a small variant's decode slows one tier's reads on this machine, at a given link speed, from the
    store's own loads.  Where the network path or the server itself runs on the decoder's cores, decoding is not
    free for the link (measured here: a raw fetch from Redis on loopback took 1.5x as long beside a kvtc decode,
    2.7x beside a cachegen one); behind a slower link the shaper, not the cores, sets the pace, and a decode costs
    it nothing.  So each measurement is a pair of large values' reads (each a value's whole read and check, as the
    load times it) ending within ``PAIR_S`` of each other, one with no small decode running and one beside such a
    decode (a link that changes speed in between moves one pair, not the estimate): the ratio of their
    throughputs, kept with the first one's.  :meth:`slowdown` is the median ratio of the pairs measured within 2x
    of the speed asked about, 1 where there are none."""

    # Two values' reads end at least one read apart: a 12 MB raw chunk took 35 ms inside vLLM at 10 Gbit/s and
    # 90-110 ms beside a kvtc decode, about 130 ms at 1 Gbit/s.
    PAIR_S = 0.5
    WINDOW = 16

    def __init__(self) -> None:
        self._last: dict[bool, tuple[float, float]] = {}  # beside_decode: (when, bytes/s) of the latest read
        self._pairs: deque[tuple[float, float]] = deque(maxlen=self.WINDOW)  # (bytes/s alone, ratio)
        self.measured_at: float | None = None  # the wall-clock time of the latest pair

    def observe(self, nbytes: int, seconds: float, *, beside_decode: bool) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        now, rate = time.perf_counter(), nbytes / seconds
        self._last[beside_decode] = (now, rate)
        other = self._last.get(not beside_decode)
        if other is not None and now - other[0] <= self.PAIR_S:
            alone, beside = (other[1], rate) if beside_decode else (rate, other[1])
            self._pairs.append((alone, alone / beside))
            self.measured_at = time.time()

    @property
    def pairs(self) -> tuple[tuple[float, float], ...]:
        """The pairs measured, oldest first: (bytes/s alone, how many times longer beside a decode)."""
        return tuple(self._pairs)

    def seed(self, pairs: Iterable[tuple[float, float]], measured_at: float) -> None:
        """Take ``pairs`` (an earlier process's) as measured; new pairs push them out."""
        self._pairs.extend((float(a), float(r)) for a, r in pairs)
        self.measured_at = measured_at

    def slowdown(self, bps: float) -> float:
        """How many times longer a read takes beside a small decode than alone, on a link of ``bps`` bytes/s."""
        ratios = [r for alone, r in self.pairs if bps / 2 <= alone <= bps * 2]
        return max(1.0, statistics.median(ratios)) if ratios else 1.0


class Link:
    """One tier's link as this process measured it: ``throughput`` (bytes/s, following a change of ``LINK_FOLLOW``
    times at once) and ``contention``."""

    def __init__(self, prior_bps: float = LINK_PRIOR_BPS) -> None:
        self.throughput = RateEstimator(prior_bps, follow=LINK_FOLLOW)
        self.contention = Contention()
        self.timed_at: float | None = None  # wall-clock time of the latest read of a round trip or longer

    def measures(self, nbytes: int, seconds: float) -> bool:
        """Whether a read of ``nbytes`` in ``seconds`` measures the link: any but one shorter than
        ``ROUND_TRIP_S`` that looks slower than the estimate (its time is the round trip's)."""
        return seconds >= ROUND_TRIP_S or seconds <= 0 or nbytes / seconds >= self.throughput.estimate

    def observe(self, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` in ``seconds``, into the throughput where it :meth:`measures` the link."""
        if self.measures(nbytes, seconds):
            self.throughput.observe(nbytes, seconds)
            if seconds >= ROUND_TRIP_S:
                self.timed_at = time.time()

    def read_whole(self, seconds: float) -> None:
        """A value read whole in pieces over ``seconds`` of reading: it timed the link where that is a round trip or
        longer, however short each piece (the pieces measure the throughput themselves)."""
        if seconds >= ROUND_TRIP_S:
            self.timed_at = time.time()

    def timed(self, within_s: float) -> bool:
        """Whether a read of at least ``ROUND_TRIP_S`` measured the link within the last ``within_s`` seconds (an
        estimate restored from another process, or moved by short reads alone, was not timed)."""
        return self.timed_at is not None and time.time() - self.timed_at < within_s


@dataclass(frozen=True)
class Measured:
    """An estimate (a rate, or :class:`Contention`'s pairs) and the wall-clock time (``time.time()``) of the latest
    measurement in it."""

    value: float | tuple[tuple[float, float], ...]
    at: float


@dataclass
class Estimates:
    """What a store measured, to start another process's with: each tier's throughput (bytes/s) and
    :class:`Contention` pairs by tier name, each variant's decode rate (tokens/s) by ``repr(codec)``, and the
    engine's prefill speed (tokens/s)."""

    links: dict[str, Measured] = field(default_factory=dict)
    contention: dict[str, Measured] = field(default_factory=dict)
    decode: dict[str, Measured] = field(default_factory=dict)
    prefill: Measured | None = None


class Telemetry:
    """A store's measurements: a :class:`Link` per tier name (:meth:`link`), a decode rate in tokens per second
    per codec variant (:meth:`decode_rate`, by ``repr(codec)``), and ``prefill``: the engine's prefill speed in
    tokens per second, as its hook times it (no samples until one does; the prior is never planned with): what a
    load weighs against recomputing, kept so that a fresh engine's first load can weigh it too."""

    def __init__(self, tiers: Iterable[str]) -> None:
        self.links = {name: Link() for name in tiers}
        self._decode: dict[str, RateEstimator] = {}
        self.prefill = RateEstimator(prior=1.0)
        self.loads_planned = 0  # prefix loads planned in this process (its first is planned apart: LoadPlanner)
        self._lock = threading.Lock()

    def link(self, tier: str) -> Link:
        return self.links[tier]

    def decode_rate(self, codec: object) -> RateEstimator:
        """``codec``'s decode rate (tokens/s) from this store's own loads; unmeasured, a codec decodes for free."""
        with self._lock:
            return self._decode.setdefault(repr(codec), RateEstimator(DECODE_PRIOR_TPS))

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` from ``tier`` in ``seconds`` (a :class:`~kvcodec.store.source.ChunkSource`
        observer)."""
        self.links[tier].observe(nbytes, seconds)

    def estimates(self) -> Estimates:
        """What this store has measured (a restored decode rate or contention counts until pushed out; a restored
        link throughput, a prior, does not)."""
        out = Estimates()
        for name, link in self.links.items():
            if link.throughput.samples and link.throughput.measured_at is not None:
                out.links[name] = Measured(link.throughput.estimate, link.throughput.measured_at)
            pairs = link.contention.pairs
            if pairs and link.contention.measured_at is not None:
                out.contention[name] = Measured(pairs, link.contention.measured_at)
        with self._lock:
            decode = list(self._decode.items())
        for key, rate in decode:
            if rate.samples and rate.measured_at is not None:
                out.decode[key] = Measured(rate.estimate, rate.measured_at)
        if self.prefill.samples and self.prefill.measured_at is not None:
            out.prefill = Measured(self.prefill.estimate, self.prefill.measured_at)
        return out

    def restore(self, estimates: Estimates) -> None:
        """Start from ``estimates`` (an earlier process's, for tiers of these names).  A link's throughput becomes
        its prior, which its first read replaces whole: a link may have changed since, and a rise must show at
        once.  A decode rate becomes a sample, which the next ``window`` decodes push out: it is this machine's,
        and the planner trusts only a measured rate (an unmeasured variant is fetched beside its large one, to
        find out); so are contention pairs and the engine's prefill speed."""
        for name, m in estimates.links.items():
            if name in self.links:
                self.links[name].throughput.prior = float(m.value)  # type: ignore[arg-type]
        for name, m in estimates.contention.items():
            if name in self.links:
                self.links[name].contention.seed(m.value, m.at)  # type: ignore[arg-type]
        with self._lock:
            for key, m in estimates.decode.items():
                rate = self._decode.setdefault(key, RateEstimator(DECODE_PRIOR_TPS))
                rate.seed(m.value, m.at)  # type: ignore[arg-type]
        if estimates.prefill is not None:  # the machine's too, and as a sample: the next steps push it out
            self.prefill.seed(estimates.prefill.value, estimates.prefill.at)  # type: ignore[arg-type]
