"""The pure-Python ANS reference against constriction, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

constriction = pytest.importorskip("constriction")

from kvcodec.tools.ans_reference import (  # noqa: E402
    MAX_ALPHABET,
    TOTAL,
    AnsReferenceCoder,
    categorical_model,
    constriction_decode,
    constriction_encode,
    cumulative,
    reference_decode,
    reference_encode,
    validate_freqs,
)


# --------------------------------------------------------------------------- #
# Tables
# --------------------------------------------------------------------------- #
def random_table(rng, n: int, concentration: float = 1.0) -> np.ndarray:
    """Integer table with every f >= 1 and sum exactly 2**24."""
    extra = rng.multinomial(TOTAL - n, rng.dirichlet(np.full(n, concentration)))
    return (1 + extra).astype(np.int64)


def uniform_table(n: int) -> np.ndarray:
    f = np.full(n, TOTAL // n, dtype=np.int64)
    f[-1] += TOTAL - int(f.sum())
    return f


def dominant_table(n: int, top: int = 0) -> np.ndarray:
    """One symbol with 2**24 - (n-1), all others 1."""
    f = np.ones(n, dtype=np.int64)
    f[top] = TOTAL - (n - 1)
    return f


def sample(rng, freqs, size: int) -> np.ndarray:
    p = freqs / TOTAL
    return rng.choice(len(freqs), size=size, p=p).astype(np.int32)


def entropy_bits(symbols, freqs) -> float:
    return float(-np.log2(freqs[symbols] / TOTAL).sum())


def check_lane(runs):
    """Encode with both, compare words, decode each side's words with both."""
    ref = reference_encode(runs)
    con = constriction_encode(runs)
    assert ref.dtype == np.uint32 and con.dtype == np.uint32
    assert np.array_equal(ref, con), "reference and constriction streams differ"
    if ref.size:
        assert ref[-1] != 0  # an ANS stream never ends in a zero word
    spec = [(len(s), f) for s, f in runs]
    for decoded in (reference_decode(con, spec), constriction_decode(ref, spec)):
        assert len(decoded) == len(runs)
        for out, (sym, _) in zip(decoded, runs):
            assert np.array_equal(out, np.asarray(sym, dtype=np.int32))
    return ref


# --------------------------------------------------------------------------- #
# The exact-table trick
# --------------------------------------------------------------------------- #
def probe_cumulative(freqs) -> list[int]:
    """Read constriction's left cumulatives: encoding symbol s alone onto an
    empty coder leaves state == c[s], which get_compressed() returns."""
    model = categorical_model(freqs)
    out = []
    for s in range(len(freqs)):
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(np.array([s], dtype=np.int32), model)
        words = coder.get_compressed()
        assert len(words) <= 1
        out.append(int(words[0]) if len(words) else 0)
    return out


@pytest.mark.parametrize(
    "freqs",
    [
        dominant_table(2),
        dominant_table(300, top=7),
        dominant_table(MAX_ALPHABET, top=MAX_ALPHABET - 1),
        uniform_table(3),
        uniform_table(MAX_ALPHABET),
        random_table(np.random.default_rng(5), 1000, 0.05),
        np.array([1, TOTAL - 2, 1]),
    ],
    ids=["dom2", "dom300", "dom4096-last", "uni3", "uni4096", "rand1000", "1-big-1"],
)
def test_exact_integer_table_is_reproduced(freqs):
    assert probe_cumulative(freqs) == cumulative(freqs)[:-1]


@pytest.mark.parametrize(
    "bad",
    [
        np.array([[1, TOTAL - 1]]),  # 2-D
        np.array([0.5, TOTAL - 0.5]),  # float
        np.array([TOTAL]),  # single symbol: constriction cannot model it
        np.array([0, TOTAL]),  # a zero frequency
        np.array([2, TOTAL - 1]),  # wrong sum
        np.ones(MAX_ALPHABET + 1, dtype=np.int64),  # too many entries (and wrong sum)
        np.concatenate([[TOTAL - MAX_ALPHABET], np.ones(MAX_ALPHABET, dtype=np.int64)]),  # 4097
    ],
)
def test_bad_tables_raise(bad):
    with pytest.raises(ValueError):
        validate_freqs(bad)
    with pytest.raises(ValueError):
        categorical_model(bad)


def test_symbols_out_of_range_raise():
    f = uniform_table(4)
    with pytest.raises(ValueError):
        reference_encode([(np.array([4]), f)])
    with pytest.raises(ValueError):
        reference_encode([(np.array([-1]), f)])


# --------------------------------------------------------------------------- #
# Lanes
# --------------------------------------------------------------------------- #
def test_single_run():
    rng = np.random.default_rng(0)
    f = random_table(rng, 16)
    words = check_lane([(sample(rng, f, 1000), f)])
    assert len(words) > 2


def test_docs_example_matches():
    # constriction's own documented example (float32 probabilities, not our
    # exact-table path) still runs through the same coder state machine.
    probs = np.array([0.2, 0.4, 0.1, 0.3], dtype=np.float32)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(np.array([0, 3, 2, 3, 2, 0, 2, 1], dtype=np.int32),
                         constriction.stream.model.Categorical(probs, perfect=False))
    assert coder.get_compressed().tolist() == [2484720979, 175]


def test_several_runs_with_different_tables_in_order():
    rng = np.random.default_rng(1)
    tables = [
        random_table(rng, 256, 0.1),  # skewed
        uniform_table(16),
        dominant_table(64, top=3),  # near-degenerate
        random_table(rng, 2),
        uniform_table(MAX_ALPHABET),
        dominant_table(2, top=1),
    ]
    runs = [(sample(rng, f, 700 + 50 * i), f) for i, f in enumerate(tables)]
    # force the rare symbols of the near-degenerate table to appear
    runs[2][0][:5] = [0, 63, 1, 2, 62]
    words = check_lane(runs)
    # the multi-model pattern is order-sensitive: decoding with the runs in any
    # other order does not give the inputs back
    spec = [(len(s), f) for s, f in runs]
    swapped = reference_decode(words, [spec[1], spec[0]] + spec[2:])
    assert not np.array_equal(swapped[0][: len(runs[1][0])], runs[1][0])


def test_near_degenerate_run_costs_almost_nothing():
    f = dominant_table(16)
    sym = np.zeros(20_000, dtype=np.int32)  # all dominant symbol 0
    sym[10_000] = 5  # one rare symbol: ~24 bits
    words = check_lane([(sym, f)])
    assert len(words) <= 3


def test_empty_lane_is_empty_array():
    f = uniform_table(8)
    for runs in ([], [(np.zeros(0, np.int32), f)], [(np.zeros(0, np.int32), f)] * 3):
        words = check_lane(runs)
        assert words.shape == (0,)
    # decoding an empty stream is total: symbol 0 forever, no words consumed
    assert [x.tolist() for x in reference_decode(np.zeros(0, np.uint32), [(4, f)])] == [[0, 0, 0, 0]]
    assert [x.tolist() for x in constriction_decode(np.zeros(0, np.uint32), [(4, f)])] == [[0, 0, 0, 0]]


def test_symbol_zero_from_empty_state_is_free():
    # Surprise: from state 0, symbol 0 (cumulative 0) keeps state 0, so a lane
    # whose decode-order tail is symbol 0 pays nothing for that tail, and an
    # all-zero lane serialises to no words at all.
    f = random_table(np.random.default_rng(2), 10)
    assert check_lane([(np.zeros(500, np.int32), f)]).shape == (0,)
    body = np.array([3, 1, 4], dtype=np.int32)
    a = check_lane([(body, f)])
    b = check_lane([(np.concatenate([body, np.zeros(1000, np.int32)]), f)])
    assert np.array_equal(a, b)


def test_long_lane_and_renormalisation():
    rng = np.random.default_rng(3)
    tables = [random_table(rng, 16, 0.5), random_table(rng, 1024, 0.2)]
    runs = [(sample(rng, f, 10_000), f) for f in tables]
    words = check_lane(runs)

    coder = AnsReferenceCoder()
    for sym, f in reversed(runs):
        coder.encode_reverse(sym, f)
    assert coder.max_renorm_steps == 1  # renormalisation happened, never twice
    assert coder.state >= 1 << 32  # invariant: full state once words were written
    assert np.array_equal(coder.get_compressed(), words)
    # flush = bulk words followed by the state's low word, then high word
    assert words[-2:].tolist() == [coder.state & 0xFFFFFFFF, coder.state >> 32]
    assert words[:-2].tolist() == coder.bulk

    # decoder init reads back exactly the encoder's final state
    dec = AnsReferenceCoder.from_compressed(words)
    assert dec.state == coder.state and dec.bulk == coder.bulk
    for sym, f in runs:
        assert np.array_equal(dec.decode(f, len(sym)), sym)
    assert dec.max_renorm_steps == 1
    assert dec.is_empty()

    # cost: about the entropy plus a few dozen bits for the flush
    ideal = sum(entropy_bits(s, f) for s, f in runs)
    assert 0 <= 32 * len(words) - ideal < 64


def test_renormalisation_boundary_is_inclusive():
    # The encoder flushes a word when state >> 40 >= f (not >). With f == 1
    # symbols the equality case is common; the stream must still match.
    f = np.array([TOTAL - 3, 1, 1, 1])
    c = cumulative(f)
    sym = np.random.default_rng(4).integers(0, 4, 3000).astype(np.int32)
    coder = AnsReferenceCoder()
    hits = 0
    for s in sym[::-1]:
        freq = c[s + 1] - c[s]
        hits += (coder.state >> 40) == freq
        coder.encode_symbol(c[s], freq)
    assert hits > 0
    assert np.array_equal(coder.get_compressed(), check_lane([(sym, f)]))


def test_trailing_zero_word_rejected_by_both():
    bad = np.array([7, 0], dtype=np.uint32)
    with pytest.raises(ValueError):
        AnsReferenceCoder.from_compressed(bad)
    with pytest.raises(ValueError):
        constriction.stream.stack.AnsCoder(bad)


# --------------------------------------------------------------------------- #
# Random tables and lanes
# --------------------------------------------------------------------------- #
@st.composite
def lanes(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    n_runs = draw(st.integers(0, 4))
    rng = np.random.default_rng(seed)
    runs = []
    for _ in range(n_runs):
        kind = draw(st.sampled_from(["random", "uniform", "dominant"]))
        n = draw(st.sampled_from([2, 3, 5, 16, 17, 255, MAX_ALPHABET]))
        if kind == "random":
            f = random_table(rng, n, draw(st.sampled_from([0.02, 0.3, 1.0, 10.0])))
        elif kind == "uniform":
            f = uniform_table(n)
        else:
            f = dominant_table(n, top=int(rng.integers(n)))
        count = draw(st.integers(0, 400))
        runs.append((sample(rng, f, count), f))
    return runs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lanes())
def test_random_lanes_bit_exact(runs):
    check_lane(runs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words=st.lists(st.integers(0, 2**32 - 1), max_size=12).map(
        lambda w: w[:-1] + [w[-1] or 1] if w else w),
    seed=st.integers(0, 2**32 - 1),
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=3),
)
def test_decoder_agrees_on_arbitrary_words(words, seed, counts):
    # Decoding is total (also past the end of the data); both sides must agree
    # on any valid stream, not only on streams they produced.
    rng = np.random.default_rng(seed)
    spec = [(c, random_table(rng, int(rng.integers(2, 40)), 0.5)) for c in counts]
    w = np.array(words, dtype=np.uint32)
    for a, b in zip(reference_decode(w, spec), constriction_decode(w, spec)):
        assert np.array_equal(a, b)
