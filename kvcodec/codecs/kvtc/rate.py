"""kvtc's rate control (``kvtc:bits=B``): the step codes that make a frame's section ``B`` bits per element.

Each part (keys or values of a group) of a frame gets its own step codes: components ``[0, m)`` use ``lead``,
the rest ``code`` (spec/kvtc.md, "Rate mode").  Keys' and values' codes keep the levels' ratio (a fixed
offset in code units), so one scale, the key code ``c``, moves the whole frame; a code is 2**(1/8) apart from
the next, about 10% of the rate at the rates kvtc is used at, too coarse for +-5%, so the frame then moves from
``c`` to ``c - 1`` part by part and within one part by its leading ``m`` components (the largest first), which
makes the rate nearly continuous.

The search prices candidates from the symbols themselves (:func:`quantize.symbol_bits`: the cheapest table's
code lengths, what ANS then spends within 0.1%), starting from a prediction made from the calibration's component
variances (the entropy of a Gaussian at that step, read off the codebook's own tables), and corrects the
prediction by each measurement; typically two or three codes are priced.  A part's fine rows (its fine part,
coded at its codes made finer) ride on it: priced with it, never moved alone.  The encoder then codes the frame once
and, if the bytes miss the estimate by more than :data:`RETRY_FRACTION`, corrects the target by the miss and
codes it again.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvcodec.codecs.entropy.tables import STEPS, codebook, table_scale
from kvcodec.codecs.kvtc.quantize import quantize, symbol_bits
from kvcodec.formats.cachegen import NUM_TABLES, PRECISION

PART_HEAD = 10  # code, lead (u8 each), m, n_over (u32 each)
FINE_PART_HEAD = 4  # n_over
OVERRIDE_BYTES = 5
LANE_FLUSH_BYTES = 4.0  # what an ANS lane's final state adds beyond its symbols' code lengths, on average
RETRY_FRACTION = 0.005
GUIDED_TRIALS = 4


@dataclass(frozen=True)
class PartSteps:
    """A part's step codes in rate mode: components ``[0, m)`` on ``lead``, the others on ``code``."""

    code: int
    lead: int
    m: int


@functools.lru_cache(maxsize=1)
def _table_entropy() -> tuple[np.ndarray, np.ndarray]:
    """log2 of each codebook table's std (in steps) and its entropy in bits: a Gaussian's rate at that step."""
    p = codebook().astype(np.float64) / (1 << PRECISION)
    return np.log2([table_scale(j) for j in range(NUM_TABLES)]), -(p * np.log2(p)).sum(1)


def gaussian_bits(log2_std_over_step: np.ndarray) -> np.ndarray:
    """Bits per symbol of a Gaussian of that std (in steps) quantized and coded: its codebook table's entropy,
    interpolated, 0 far below a step, and one more bit per doubling past the widest table."""
    x, h = _table_entropy()
    return np.where(log2_std_over_step > x[-1], h[-1] + (log2_std_over_step - x[-1]),
                    np.interp(log2_std_over_step, x, h, left=0.0))


class PartPricing:
    """One part of a frame of ``tokens`` tokens: its coefficients (``project(a, b)``: on components ``[a, b)``,
    ``[b - a, T]`` float64, computed as far as the codes priced need them: a low rate codes few components) and
    what coding them costs at each step code, priced once per code."""

    def __init__(self, project: Callable[[int, int], np.ndarray], tokens: int, std: np.ndarray,
                 count: Callable[[int], int], offset: int, lane_components: int, lane_tokens: int,
                 rider: PartPricing | None = None, rider_shift: int = 0, tables: bool = True) -> None:
        self.project, self.tokens, self.std, self.count, self.offset = project, tokens, std, count, offset
        self.lane_components, self.lane_tokens = lane_components, lane_tokens
        # the part's fine rows (kvtc's fine part): coded at the part's codes less ``rider_shift``, priced with it
        self.rider, self.rider_shift = rider, rider_shift
        # a fine part has no head, table bytes or base of its own: only its count of overrides
        self.head, self.table_bytes = (PART_HEAD, 1) if tables else (FINE_PART_HEAD, 0)
        self._coeff = np.zeros((0, tokens))
        self._trials: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def coefficients(self, k: int) -> np.ndarray:
        """The coefficients of the first ``k`` components ``[k, T]``."""
        if k > len(self._coeff):
            self._coeff = np.concatenate([self._coeff, self.project(len(self._coeff), k)])
        return self._coeff[:k]

    def trial(self, code: int) -> tuple[np.ndarray, np.ndarray]:
        """Per component coded at ``code``: its bits and whether its step had to be coarsened (an override)."""
        if code not in self._trials:
            k = self.count(code)
            used, q = quantize(self.coefficients(k), np.full(k, code, np.int64))
            self._trials[code] = (symbol_bits(q), used != code)
        return self._trials[code]

    def _bytes(self, bits: np.ndarray, over: np.ndarray, live: np.ndarray, k: np.ndarray) -> np.ndarray:
        lanes = np.ceil(live / self.lane_components) * math.ceil(self.tokens / self.lane_tokens)
        return self.head + self.table_bytes * k + OVERRIDE_BYTES * over + lanes * (2 + LANE_FLUSH_BYTES) + bits / 8

    def _rider_code(self, code: Any) -> Any:
        """The fine part's code(s) at the part's ``code`` (an int or an array), as kvtc's ``_fine_codes``."""
        return np.maximum(code - self.rider_shift, 0)

    def uniform_bytes(self, code: int) -> float:
        bits, over = self.trial(code)
        own = float(self._bytes(bits.sum(), over.sum(), np.count_nonzero(bits), np.array(len(bits))))
        return own + (self.rider.uniform_bytes(self._rider_code(code)) if self.rider else 0.0)

    def prefix_bytes(self, code: int, lead: int) -> np.ndarray:
        """Estimated bytes of :class:`PartSteps` ``(code, lead, m)`` for every ``m`` in ``0..count(lead)``."""
        lb, lo = self.trial(lead)
        rb, ro = self.trial(code)
        m = np.arange(len(lb) + 1)
        k = np.maximum(m, len(rb))
        cum = lambda a: np.concatenate([[0], np.cumsum(a)])  # noqa: E731
        tail = lambda a: cum(a)[-1] - cum(a)[np.minimum(m, len(a))]  # noqa: E731  (components m.. of the rest)
        own = self._bytes(cum(lb)[m] + tail(rb), cum(lo)[m] + tail(ro), cum(lb > 0)[m] + tail(rb > 0), k)
        if self.rider is None:
            return own
        return own + self.rider.prefix_bytes(self._rider_code(code), self._rider_code(lead))[:len(own)]

    def predicted_bytes(self, codes: np.ndarray) -> np.ndarray:
        """Bytes at each step code in ``codes`` predicted from the calibration's variances alone."""
        log_std = np.log2(np.maximum(self.std, 1e-30))
        bits = gaussian_bits(log_std[None, :] - np.log2(STEPS[codes].astype(np.float64))[:, None]).sum(1)
        own = self.head + bits * self.tokens / 8
        return own + (self.rider.predicted_bytes(self._rider_code(codes)) if self.rider else 0.0)


def choose_steps(parts: list[PartPricing], fixed: int, target: float) -> tuple[list[PartSteps], float, bool]:
    """Step codes of every part whose estimated bytes (plus ``fixed``) come nearest ``target``; the estimate,
    and whether the target was out of reach (then the nearest end of the code range is used)."""
    top = 255 - max(p.offset for p in parts)
    uniform = lambda c: fixed + sum(p.uniform_bytes(c + p.offset) for p in parts)  # noqa: E731
    codes = np.arange(top + 1)
    predicted = fixed + sum(p.predicted_bytes(codes + p.offset) for p in parts)
    # over: the coarsest code known to give more than the target; under: the finest known to give at most it
    over, under, measured = -1, top + 1, {}
    goal = math.log(max(target, 1.0))  # a target below nothing (the frame's head alone is over it): the coarsest
    c = int(np.argmin(np.abs(np.log(predicted) - goal)))
    while True:
        measured[c] = uniform(c)
        if measured[c] > target:
            over = max(over, c)
        else:
            under = min(under, c)
        if under - over <= 1:
            break
        # the prediction, scaled by its miss at the nearest measured code, names the next code inside the
        # bracket; after a few trials, bisection (each trial prices a new code inside the bracket, so this ends)
        near = min(measured, key=lambda m: abs(m - c))
        guess = int(np.argmin(np.abs(np.log(predicted * measured[near] / predicted[near]) - goal)))
        c = min(max(guess, over + 1), under - 1) if len(measured) < GUIDED_TRIALS else (over + under) // 2
        if c in measured:
            c = (over + under) // 2
    if under > top:  # even the coarsest code gives more
        return [PartSteps(top + p.offset, top + p.offset, 0) for p in parts], uniform(top), True
    if over < 0:  # even the finest code gives at most the target
        return [PartSteps(p.offset, p.offset, 0) for p in parts], measured[0], True
    # from `under` towards `over`: whole parts first, then the leading components of one
    steps = [PartSteps(under + p.offset, under + p.offset, 0) for p in parts]
    total = measured[under]
    for i, p in enumerate(parts):
        coarse, fine = under + p.offset, over + p.offset
        gain = p.uniform_bytes(fine) - p.uniform_bytes(coarse)
        if total + gain <= target:
            steps[i], total = PartSteps(fine, fine, 0), total + gain
            continue
        sizes = total - p.uniform_bytes(coarse) + p.prefix_bytes(coarse, fine)
        m = int(np.argmin(np.abs(sizes - target)))
        steps[i], total = PartSteps(coarse, fine, m), float(sizes[m])
        break
    return steps, total, False
