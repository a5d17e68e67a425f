"""Pure-Python reference of constriction's ``AnsCoder`` as kvcodec uses it.

This module is the specification for the GPU (Triton) ANS kernels.  It follows
``constriction.stream.stack.AnsCoder`` (constriction 0.5, ``DefaultAnsCoder``
= ``AnsCoder<u32, u64>``) bit for bit, restricted to kvcodec's configuration:

* 32-bit words, a 64-bit state, ``PRECISION = 24`` bits of probability;
* models are ``Categorical(weights, perfect=False)`` built from an exact integer
  table (see :func:`categorical_model`);
* one coder per lane: several runs, each with its own table, are pushed with
  ``encode_reverse`` in *reverse* run order (last run first), then the lane is
  serialised with ``get_compressed()``; the decoder pops the runs in forward
  order with ``AnsCoder(words).decode(model, count)``.

Everything below uses plain Python ints; the masks make the u64/u32 widths
explicit.  Speed is a non-goal.

The state machine (``M = 2**24``, ``f``/``c`` = frequency and left cumulative
of the symbol, ``L = 2**32`` = lower bound of a "full" state)
-----------------------------------------------------------------------------

Encoder (the ANS "push"; symbols go in reverse of decode order):

1. **Initial state**: ``state = 0``, ``bulk = []`` (no words).  There is no
   ``L``-sized starting value: the state grows from zero, so the first
   symbols cost nothing to start.
2. **Encode one symbol** ``s``:

   a. *Renormalise* (at most once): if ``state >> 40 >= f`` then append the
      low word ``state & 0xFFFFFFFF`` to ``bulk`` and set ``state >>= 32``.
      (``40 = 64 - PRECISION``.)  After this ``state >> 40 == 0 < f``, so a
      second step is never needed; :class:`AnsReferenceCoder` writes it as a
      ``while`` loop and checks that it runs at most once.
   b. *Update*: ``state = ((state // f) << 24) | (c + state % f)``.
      ``state // f < 2**40`` after (a), so the result fits in 64 bits.

   Invariant: whenever ``bulk`` is non-empty, ``state >= L``.
   Surprise: from ``state == 0``, encoding a symbol with ``c == 0`` (symbol 0)
   leaves ``state == 0``.  Trailing symbol-0s (in decode order) at the end of
   a lane are therefore free, and a lane made only of symbol 0 serialises to
   *zero* words, exactly like an empty lane.
3. **Flush** (``get_compressed``): append the state's 32-bit chunks, least
   significant first, dropping the most significant all-zero chunks:
   ``state >= 2**32`` -> ``[lo, hi]``; ``0 < state < 2**32`` -> ``[lo]``;
   ``state == 0`` -> nothing.  The result is ``bulk + those``; the
   renormalisation words come first (in the order they were written) and the
   state's high word is the *last* word.  The stream never ends in a zero
   word.  A lane with no symbols is the empty array.

Decoder (pops from the *end* of the word array, like a stack):

4. **Initial state** (``AnsCoder(words)``): if ``words`` is empty,
   ``state = 0``.  Otherwise pop the last word ``w``; it must be non-zero
   (constriction raises ``ValueError`` otherwise); ``state = w``; then, while
   words remain, pop one ``w`` and set ``state = (state << 32) | w``, stopping
   as soon as ``state >= L``.  Since the first word is non-zero this reads at
   most two words: exactly the inverse of the flush.
5. **Decode one symbol**:

   a. ``slot = state & (M - 1)`` (the low 24 bits).
   b. Find the symbol ``s`` with ``c[s] <= slot < c[s + 1]`` (constriction
      does a binary search over the cumulative table ``c``, ``c[n] = M``).
   c. ``state = (state >> 24) * f[s] + (slot - c[s])``.
   d. *Refill* (at most once): if ``state < L`` and a word remains, pop it and
      set ``state = (state << 32) | w``.  One word is always enough: before
      (c) ``state >= L`` unless the stream is exhausted, so after (c)
      ``state >= 2**8``, and after one refill ``state >= 2**40``.

   Decoding is total: past the end of the data (``state == 0``) it keeps
   returning symbol 0 without consuming anything, consistent with the
   free-symbol-0 rule above.  After decoding exactly what was encoded the
   coder is back to ``state == 0`` with no words left (``is_empty()``).

Model (exact integer table)
---------------------------

``Categorical(w, perfect=False)`` calls constriction's
``from_floating_point_probabilities_fast``: with ``n = len(w)``,
``free = 2**24 - n``, ``norm = sum(w)`` (left-to-right float sum) and
``scale = free / norm`` it sets the left cumulative of symbol ``i`` to
``floor(sum(w[:i]) * scale) + i`` and ``c[n] = 2**24``.  Passing
``w_i = f_i - 1`` for integers ``f_i >= 1`` with ``sum(f) == 2**24`` makes every
partial sum an exact integer below ``2**53``, ``norm == free`` exactly, hence
``scale == 1.0`` and ``c[i] = sum(f[:i] - 1) + i = sum(f[:i])``: the frequencies
come back unchanged.  No leftover is redistributed (the fast path has no
leftover step; the last symbol just takes ``2**24 - c[n-1]``, which here is
``f[n-1]``).  Constriction rejects ``n < 2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PRECISION = 24
WORD_BITS = 32
STATE_BITS = 64
TOTAL = 1 << PRECISION  # M: every table's frequencies sum to this
MAX_ALPHABET = 4096  # kvcodec's own bound on table size

WORD_MASK = (1 << WORD_BITS) - 1
STATE_MASK = (1 << STATE_BITS) - 1
SLOT_MASK = TOTAL - 1
STATE_LOWER = 1 << (STATE_BITS - WORD_BITS)  # L = 2**32
ENC_SHIFT = STATE_BITS - PRECISION  # 40: renormalise when state >> 40 >= f

__all__ = [
    "PRECISION",
    "TOTAL",
    "MAX_ALPHABET",
    "AnsReferenceCoder",
    "validate_freqs",
    "cumulative",
    "categorical_model",
    "reference_encode",
    "reference_decode",
    "constriction_encode",
    "constriction_decode",
]


# --------------------------------------------------------------------------- #
# Tables
# --------------------------------------------------------------------------- #
def validate_freqs(freqs) -> np.ndarray:
    """Check an integer frequency table and return it as int64.

    Requirements: 1-D, integer dtype, ``2 <= len <= MAX_ALPHABET`` (constriction
    cannot model a one-symbol alphabet), every entry ``>= 1`` and the sum
    exactly ``2**24``.  Raises ``ValueError`` otherwise.
    """
    arr = np.asarray(freqs)
    if arr.ndim != 1:
        raise ValueError(f"frequency table must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"frequency table must have an integer dtype, got {arr.dtype}")
    n = arr.shape[0]
    if n < 2:
        raise ValueError(f"frequency table needs at least 2 entries, got {n}")
    if n > MAX_ALPHABET:
        raise ValueError(f"frequency table has {n} entries, at most {MAX_ALPHABET} allowed")
    arr = arr.astype(np.int64)
    if int(arr.min()) < 1:
        raise ValueError("every frequency must be >= 1")
    total = int(arr.sum())
    if total != TOTAL:
        raise ValueError(f"frequencies must sum to 2**{PRECISION} = {TOTAL}, got {total}")
    return arr


def cumulative(freqs) -> list[int]:
    """Left cumulative table ``c`` with ``c[0] = 0`` and ``c[n] = 2**24``."""
    f = validate_freqs(freqs)
    c = [0]
    for x in f.tolist():
        c.append(c[-1] + x)
    return c


def categorical_model(freqs):
    """Constriction model that reproduces the integer table ``freqs`` exactly.

    Uses float64 weights ``f_i - 1`` with ``perfect=False`` (see the module
    docstring for why this is exact).
    """
    import constriction

    f = validate_freqs(freqs)
    weights = (f - 1).astype(np.float64)
    return constriction.stream.model.Categorical(weights, perfect=False)


def _check_symbols(symbols, n: int) -> list[int]:
    s = np.asarray(symbols)
    if s.ndim != 1:
        raise ValueError(f"symbols must be 1-D, got shape {s.shape}")
    if s.size and s.dtype.kind not in "iu":
        raise ValueError(f"symbols must be integers, got {s.dtype}")
    if s.size and (int(s.min()) < 0 or int(s.max()) >= n):
        raise ValueError(f"symbols must lie in [0, {n})")
    return [int(x) for x in s.tolist()]


# --------------------------------------------------------------------------- #
# The coder
# --------------------------------------------------------------------------- #
class AnsReferenceCoder:
    """A stack ANS coder with constriction's exact state machine.

    ``state`` is the u64 head, ``bulk`` the list of u32 words already written
    (renormalisation output), oldest first.  ``max_renorm_steps`` records the
    most renormalisation/refill steps any single symbol needed (always <= 1).
    """

    def __init__(self) -> None:
        # Step 1: initial state.
        self.state = 0
        self.bulk: list[int] = []
        self.max_renorm_steps = 0

    # -- encoder ---------------------------------------------------------- #
    def encode_symbol(self, cum: int, freq: int) -> None:
        """Push one symbol with left cumulative ``cum`` and frequency ``freq``."""
        state = self.state
        # Step 2a: renormalise. Written as a loop to show it runs at most once.
        steps = 0
        while (state >> ENC_SHIFT) >= freq:
            self.bulk.append(state & WORD_MASK)
            state >>= WORD_BITS
            steps += 1
        assert steps <= 1, "encoder needed more than one renormalisation step"
        self.max_renorm_steps = max(self.max_renorm_steps, steps)
        # Step 2b: state update (fits in u64 because state // freq < 2**40).
        state = ((state // freq) << PRECISION) | (cum + state % freq)
        assert state <= STATE_MASK
        self.state = state

    def encode_reverse(self, symbols, freqs) -> None:
        """Like ``AnsCoder.encode_reverse(symbols, model)``: last symbol first."""
        c = cumulative(freqs)
        syms = _check_symbols(symbols, len(c) - 1)
        for s in reversed(syms):
            self.encode_symbol(c[s], c[s + 1] - c[s])

    def get_compressed(self) -> np.ndarray:
        """Step 3: bulk words, then the state's non-zero-led chunks, low first."""
        chunks = []
        state = self.state
        while state:
            chunks.append(state & WORD_MASK)
            state >>= WORD_BITS
        return np.array(self.bulk + chunks, dtype=np.uint32)

    # -- decoder ---------------------------------------------------------- #
    @classmethod
    def from_compressed(cls, words) -> "AnsReferenceCoder":
        """Step 4: rebuild the head state from the end of ``words``."""
        w = np.asarray(words)
        if w.ndim != 1:
            raise ValueError("compressed words must be 1-D")
        if w.size and (w.dtype.kind not in "iu" or int(w.min()) < 0 or int(w.max()) > WORD_MASK):
            raise ValueError("compressed words must be u32 values")
        coder = cls()
        coder.bulk = [int(x) for x in w.tolist()]
        if coder.bulk:
            first = coder.bulk.pop()
            if first == 0:
                raise ValueError("ANS compressed data never ends in a zero word")
            state = first
            while coder.bulk:
                state = (state << WORD_BITS) | coder.bulk.pop()
                if state >= STATE_LOWER:
                    break
            coder.state = state
        return coder

    def decode_symbol(self, c: Sequence[int]) -> int:
        """Pop one symbol using the cumulative table ``c`` (``len(c) = n + 1``)."""
        # Step 5a: slot.
        slot = self.state & SLOT_MASK
        # Step 5b: symbol lookup, c[s] <= slot < c[s + 1] (binary search).
        lo, hi = 0, len(c) - 1  # invariant: c[lo] <= slot < c[hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if c[mid] <= slot:
                lo = mid
            else:
                hi = mid
        s = lo
        freq = c[s + 1] - c[s]
        # Step 5c: state update.
        state = (self.state >> PRECISION) * freq + (slot - c[s])
        # Step 5d: refill. Written as a loop to show it runs at most once.
        steps = 0
        while state < STATE_LOWER and self.bulk:
            if steps == 1:
                raise AssertionError("decoder needed more than one refill step")
            state = (state << WORD_BITS) | self.bulk.pop()
            steps += 1
        self.max_renorm_steps = max(self.max_renorm_steps, steps)
        self.state = state
        return s

    def decode(self, freqs, count: int) -> np.ndarray:
        """Like ``AnsCoder.decode(model, count)``."""
        c = cumulative(freqs)
        if count < 0:
            raise ValueError("count must be >= 0")
        return np.array([self.decode_symbol(c) for _ in range(count)], dtype=np.int32)

    def is_empty(self) -> bool:
        return self.state == 0 and not self.bulk


# --------------------------------------------------------------------------- #
# Lane-level helpers (kvcodec's usage pattern)
# --------------------------------------------------------------------------- #
def reference_encode(runs) -> np.ndarray:
    """Encode one lane: ``runs = [(symbols, freqs), ...]`` in forward order.

    Runs are pushed last run first (each with its own table, each reversed),
    so :func:`reference_decode` pops them in forward order.  Returns the
    ``get_compressed()`` uint32 words.
    """
    coder = AnsReferenceCoder()
    for symbols, freqs in reversed(list(runs)):
        coder.encode_reverse(symbols, freqs)
    return coder.get_compressed()


def reference_decode(words, runs_spec) -> list[np.ndarray]:
    """Decode one lane: ``runs_spec = [(count, freqs), ...]`` in forward order."""
    coder = AnsReferenceCoder.from_compressed(words)
    return [coder.decode(freqs, int(count)) for count, freqs in runs_spec]


def constriction_encode(runs) -> np.ndarray:
    """Same as :func:`reference_encode`, done by constriction."""
    import constriction

    coder = constriction.stream.stack.AnsCoder()
    for symbols, freqs in reversed(list(runs)):
        sym = np.ascontiguousarray(symbols, dtype=np.int32)
        if sym.size:
            coder.encode_reverse(sym, categorical_model(freqs))
    return np.asarray(coder.get_compressed(), dtype=np.uint32)


def constriction_decode(words, runs_spec) -> list[np.ndarray]:
    """Same as :func:`reference_decode`, done by constriction."""
    import constriction

    coder = constriction.stream.stack.AnsCoder(np.ascontiguousarray(words, dtype=np.uint32))
    out = []
    for count, freqs in runs_spec:
        count = int(count)
        if count:
            out.append(np.asarray(coder.decode(categorical_model(freqs), count), dtype=np.int32))
        else:
            out.append(np.zeros(0, dtype=np.int32))
    return out
