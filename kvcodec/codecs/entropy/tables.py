"""The fixed entropy-coding tables and step-size grid, CacheGen's, which kvtc codes with too.

Every (layer, K or V, channel) of a cachegen chunk, and every component of a kvtc
part, picks one table from a fixed codebook of discretized Gaussians and stores
only its index (one byte).  The codebook is frozen in
``kvcodec/formats/cachegen/codebook-v1.u32`` (checked by SHA-256 at load) so that every
decoder, on any platform or on the GPU, uses the very same integer frequencies;
:func:`build_codebook` is how it was made.
"""

from __future__ import annotations

import functools
import hashlib
import math
from importlib.resources import files

import numpy as np

from kvcodec.errors import CorruptDataError
from kvcodec.formats.cachegen import ALPHABET, BUCKET_BITS, CODEBOOK_FILE, CODEBOOK_SHA256, NUM_TABLES, PRECISION, RADIX

# 2**(j/8) for j = 0..7, rounded to float32 once and frozen as exact hex so every platform agrees.
_OCTAVE = np.array([float.fromhex(h) for h in (
    "0x1.000000p+0", "0x1.172b84p+0", "0x1.306fe0p+0", "0x1.4bfdaep+0",
    "0x1.6a09e6p+0", "0x1.8ace54p+0", "0x1.ae89fap+0", "0x1.d5818ep+0")], dtype=np.float32)
# A step code k in 0..255 means the float32 value 2**((k - 128) / 8), exactly ldexp(_OCTAVE[k % 8], k // 8 - 16).
STEPS = np.array([np.ldexp(_OCTAVE[k % 8], k // 8 - 16) for k in range(256)], dtype=np.float32)


def table_scale(j: int) -> float:
    """Standard deviation, in quantization steps, of codebook table ``j``."""
    return 2.0 ** (j / 4 - 3)


def build_codebook() -> np.ndarray:
    """Integer frequencies ``[NUM_TABLES, ALPHABET]``: table j is a Gaussian of std
    :func:`table_scale` (j) discretized to the integers in [-RADIX, RADIX]; every
    symbol gets at least 1, and the rounding remainder goes to symbol 0."""
    out = np.zeros((NUM_TABLES, ALPHABET), dtype=np.uint32)
    total = 1 << PRECISION
    for j in range(NUM_TABLES):
        s = table_scale(j)
        cdf = [0.5 * (1 + math.erf((k - 0.5) / (s * math.sqrt(2)))) for k in range(-RADIX, RADIX + 2)]
        p = np.diff(np.array(cdf))
        f = 1 + np.floor(p / p.sum() * (total - ALPHABET)).astype(np.int64)
        f[RADIX] += total - f.sum()
        out[j] = f
    return out


@functools.lru_cache(maxsize=1)
def codebook() -> np.ndarray:
    """The frozen codebook, verified against its recorded hash."""
    data = (files("kvcodec.formats.cachegen") / CODEBOOK_FILE).read_bytes()
    if hashlib.sha256(data).hexdigest() != CODEBOOK_SHA256:
        raise CorruptDataError(f"the installed CacheGen codebook {CODEBOOK_FILE} is damaged")
    return np.frombuffer(data, dtype="<u4").reshape(NUM_TABLES, ALPHABET)


@functools.lru_cache(maxsize=1)
def code_lengths() -> np.ndarray:
    """Bits each symbol costs under each table, ``[ALPHABET, NUM_TABLES]`` (for choosing tables)."""
    return -np.log2(codebook().astype(np.float64) / (1 << PRECISION)).T.copy()


@functools.lru_cache(maxsize=1)
def models() -> tuple:
    """One constriction ``Categorical`` per table, reproducing the integer frequencies exactly:
    constriction's fast quantizer turns float weights ``f - 1`` back into ``f`` when they sum to 2**24."""
    import constriction

    categorical = constriction.stream.model.Categorical
    return tuple(categorical(f.astype(np.float64) - 1, perfect=False) for f in codebook())


# Step code k is chosen for targets in [THRESHOLDS[k-1], THRESHOLDS[k]): the geometric midpoints between
# neighbouring step values.  Comparing against a frozen float64 table (not rounding a log2, whose last bit
# differs between math libraries) gives the same code on every platform, the GPU included.
STEP_THRESHOLDS = np.exp2((np.arange(1, 256, dtype=np.float64) - 128.5) / 8)

# Code lengths in 1/2**16 bit, rounded: a channel's cost is then a sum of integers that float64 adds
# exactly in any order, so the CPU and the GPU pick the same table even between near-equal costs.
CODE_LENGTH_UNIT = 1 << 16


def step_code(target: np.ndarray) -> np.ndarray:
    """The step code whose value is nearest ``target`` (in log terms), clipped to 0..255."""
    return np.searchsorted(STEP_THRESHOLDS, np.asarray(target, np.float64), side="right").astype(np.uint8)


@functools.lru_cache(maxsize=1)
def code_lengths_fixed() -> np.ndarray:
    """Cost of a symbol of magnitude ``m`` (0..RADIX) under each table, ``[RADIX + 1, NUM_TABLES]``, in
    units of ``1/CODE_LENGTH_UNIT`` bit.  The codebook is symmetric, so ``s`` and ``-s`` cost the same."""
    lengths = code_lengths()[RADIX:]
    return np.rint(lengths * CODE_LENGTH_UNIT)


@functools.lru_cache(maxsize=1)
def cumulative() -> np.ndarray:
    """Left cumulative frequencies ``[NUM_TABLES, ALPHABET + 1]`` (int64), last column ``2**PRECISION``:
    what a decoder searches to find the symbol of a slot."""
    cb = codebook().astype(np.int64)
    return np.concatenate([np.zeros((NUM_TABLES, 1), np.int64), np.cumsum(cb, 1)], 1)


@functools.lru_cache(maxsize=1)
def slot_buckets() -> np.ndarray:
    """Per table, the symbol whose slots hold the start of each of ``2**BUCKET_BITS`` equal buckets of the
    ``2**PRECISION`` slots, then the last symbol: ``[NUM_TABLES, 2**BUCKET_BITS + 1]`` int16.  A slot in
    bucket ``b`` decodes to a symbol in ``[lut[b], lut[b + 1]]``, nearly always a single one, so a GPU
    decoder needs one lookup where a binary search over the table needs nine dependent loads."""
    starts = np.arange(1 << BUCKET_BITS, dtype=np.int64) << (PRECISION - BUCKET_BITS)
    cum = cumulative()
    lut = [np.searchsorted(cum[j], starts, side="right") - 1 for j in range(NUM_TABLES)]
    return np.concatenate([np.array(lut), np.full((NUM_TABLES, 1), ALPHABET - 1)], 1).astype(np.int16)


def choose_tables(q: np.ndarray) -> np.ndarray:
    """Per row of symbols, the codebook table that codes it in the fewest bits (first on a tie).

    Costs are sums of integer code lengths below 2**53, so float64 adds them exactly: the Triton range
    kernel, which sums them in 64-bit integers, picks the same tables."""
    rows = q.shape[0]
    magnitude = np.minimum(np.abs(q), RADIX)  # the codebook is symmetric
    hist = np.bincount((np.arange(rows)[:, None] * (RADIX + 1) + magnitude).reshape(-1), minlength=rows * (RADIX + 1))
    # einsum's own loop, not BLAS: a matrix this small is not worth waking (or waiting for) BLAS threads
    costs = np.einsum("rm,mt->rt", hist.reshape(rows, RADIX + 1).astype(np.float64), code_lengths_fixed(), optimize=False)
    return np.argmin(costs, axis=1).astype(np.uint8)
