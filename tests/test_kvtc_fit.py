"""kvtc calibration fitting that scales: streamed moments, the truncated eigensolver, the grouping rule, format 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.codecs.kvtc import Calibration
from kvcodec.codecs.kvtc.calibration import LayerInfo
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.codecs.kvtc import eigen as kvtc_eigen
from kvcodec.codecs.kvtc.fit import Statistics, default_groups, fit_calibration
from kvcodec.codecs.kvtc.eigen import components_above, leading_eigenpairs
from kvcodec.codecs.kvtc.moments import Moments


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(2, 40), st.integers(0, 2**31 - 1), st.floats(-50, 50))
def test_streamed_moments_equal_the_batch_covariance(width, rows, seed, offset):
    """Rows added in any batches give the mean and covariance of all of them (a large common offset included:
    the shift keeps the variance from cancelling)."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + offset
    m = Moments(width)
    cut = rows // 3
    for part in (x[:cut], x[cut:cut], x[cut:]):
        m.add(part)
    assert m.count == rows
    assert torch.allclose(m.mean, x.mean(0), atol=1e-9)
    w = torch.rand(width, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) + 0.5
    assert torch.allclose(m.covariance(w), torch.cov((x * w).T).reshape(width, width), atol=1e-8)
    sub = [width - 1, 0]
    assert torch.allclose(m.select(sub).covariance(), torch.cov(x[:, sub].T), atol=1e-8)


def test_moments_leave_the_callers_rows_as_they_were():
    """The rows are shifted in a copy: float64 rows (which need no conversion) are not changed in place."""
    x = torch.randn(50, 4, dtype=torch.float64) + 3
    before = x.clone()
    m = Moments(4)
    m.add(x)
    m.add(x)
    assert torch.equal(x, before)


def test_moments_refuse_wrong_rows():
    m = Moments(3)
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        m.add(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="no feature rows"):
        m.covariance()


def _spectrum_matrix(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q
    lam = torch.arange(1, n + 1, dtype=torch.float64) ** -2.0
    return (q * lam) @ q.T, lam


@pytest.mark.parametrize("n, floor_index", [(1, 0), (7, 3), (120, 10), (120, 119)])
def test_components_above_counts_by_inertia(n, floor_index):
    cov, lam = _spectrum_matrix(n, n)
    floor = float(lam[floor_index]) * 0.999  # just under an eigenvalue: floor_index + 1 of them are above
    assert components_above(cov, floor) == floor_index + 1
    assert components_above(cov, float(lam[0]) * 2) == 0


def test_components_above_a_rank_deficient_or_zero_covariance():
    """Floor 0 keeps every component, as it means (the rounding of a rank-deficient covariance's zero eigenvalues
    must not decide); a floor that is exactly an eigenvalue, which leaves the factorization a zero pivot, is
    counted from the eigenvalues."""
    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert components_above(x.T @ x, 0.0) == 20
    assert components_above(x.T @ x, 1e-9) == 5
    assert components_above(torch.zeros(20, 20, dtype=torch.float64), 0.0) == 20
    assert components_above(torch.zeros(20, 20, dtype=torch.float64), 1.0) == 0
    assert components_above(torch.eye(6, dtype=torch.float64), 1.0) == 6


def test_randomized_fit_matches_the_exact_leading_components(monkeypatch):
    """Above EXACT_MAX, few kept components take the randomized path: the same count, orthonormal vectors spanning
    the exact leading subspace, and Ritz values within 1% of the exact eigenvalues."""
    n, k = 300, 20
    cov, lam = _spectrum_matrix(n, 3)
    floor = float(lam[k - 1]) * 0.999
    monkeypatch.setattr(kvtc_eigen, "EXACT_MAX", 100)
    var, vec, method = leading_eigenpairs(cov, floor)
    assert method == "randomized" and var.shape == (k,) and vec.shape == (n, k)
    assert torch.allclose(vec.T @ vec, torch.eye(k, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(var, lam[:k], rtol=1e-2)
    exact_var, exact_vec, exact_method = leading_eigenpairs(cov, floor * 1e-6)  # most components: full solver
    assert exact_method == "exact"
    # the captured share of each exact leading direction
    assert float((exact_vec[:, :k].T @ vec).pow(2).sum(1).min()) > 0.99
    monkeypatch.setattr(kvtc_eigen, "EXACT_MAX", 4096)
    assert leading_eigenpairs(cov, floor)[2] == "exact"


def test_full_solver_is_torchs_eigendecomposition_and_deterministic():
    """The full path (numpy's LAPACK) gives the eigenpairs torch's does (to float64 rounding; vectors up to sign), as
    float64 torch tensors, and the same bits on every call (the calibration file is named by its hash)."""
    cov, lam = _spectrum_matrix(200, 7)
    floor = float(lam[49] + lam[50]) / 2  # between two eigenvalues: 50 are above
    var, vec, method = leading_eigenpairs(cov, floor)
    assert method == "exact" and var.dtype == vec.dtype == torch.float64
    ref_var, ref_vec = torch.linalg.eigh(cov)
    ref_var, ref_vec = ref_var.flip(0), ref_vec.flip(1)
    k = int((ref_var >= floor).sum())
    assert var.shape == (k,) and vec.shape == (200, k)
    assert torch.allclose(var, ref_var[:k], rtol=1e-10, atol=0)
    assert torch.allclose((vec * ref_vec[:, :k]).sum(0).abs(), torch.ones(k, dtype=torch.float64), atol=1e-8)
    again = leading_eigenpairs(cov.clone(), floor)
    assert torch.equal(again[0], var) and torch.equal(again[1], vec)


def test_grouping_rule_bounds_the_features_per_group():
    """The fewest groups of consecutive layers with at most MAX_GROUP_FEATURES features, sizes within one."""
    llama8b = [LayerInfo(8, 128, 128, None)] * 32
    assert [len(g) for g in default_groups(llama8b, None)] == [6, 6, 5, 5, 5, 5]
    assert sum(default_groups(llama8b, None), []) == list(range(32))
    smol = [LayerInfo(3, 64, 64, None)] * 30
    assert default_groups(smol, None) == [list(range(30))]
    assert default_groups(smol, None, max_features=4096) == [list(range(15)), list(range(15, 30))]
    assert default_groups(smol, 7) == [list(range(i, min(i + 7, 30))) for i in range(0, 30, 7)]
    odd = [LayerInfo(3, 500, 500, None)] * 5  # 1500 features a layer: two fit under 4096, three do not
    assert [len(g) for g in default_groups(odd, None, max_features=4096)] == [2, 2, 1]
    windowed = [i % 3 != 2 for i in range(9)]
    assert default_groups([LayerInfo(1, 256, 256, None)] * 9, None, windowed) == [[0, 1, 3, 4, 6, 7], [2, 5, 8]]
    assert default_groups([LayerInfo(64, 128, 128, None)] * 3, None) == [[0], [1], [2]]  # 8192 a layer: one each
    with pytest.raises(InvalidInputError, match="group_layers"):
        default_groups(smol, 0)


def _rows(layers: int, width: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(4, layers * width, generator=g)
    x = torch.randn(n, 4, generator=g) @ mix + 0.05 * torch.randn(n, layers * width, generator=g)
    return list(x.split(width, 1))


def test_regrouped_statistics_fit_as_if_collected_that_way():
    """Moments collected for all layers give, block by block, the same bases as moments of finer groups."""
    layers = [LayerInfo(2, 4, 4, None)] * 4
    keys, values = _rows(4, 8, 300, 1), _rows(4, 8, 300, 2)
    ones = [torch.ones(8)] * 4
    coarse = Statistics.from_rows("toy", layers, [[0, 1, 2, 3]], keys, values, ones, ones)
    fine = Statistics.from_rows("toy", layers, [[0, 1], [2, 3]], keys, values, ones, ones)
    regrouped = coarse.regroup([[0, 1], [2, 3]])
    for a, b in zip(regrouped.keys + regrouped.values, fine.keys + fine.values):
        assert torch.allclose(a.covariance(), b.covariance(), atol=1e-10) and torch.allclose(a.mean, b.mean)
    with pytest.raises(InvalidInputError, match="not collected in one group"):
        fine.regroup([[1, 2], [0, 3]])


def test_format_2_stores_only_components_above_the_finest_floor_and_format_1_still_loads():
    layers = [LayerInfo(2, 4, 4, None)] * 2
    keys, values = _rows(2, 8, 400, 3), _rows(2, 8, 400, 4)
    ones = [torch.ones(8)] * 2
    cal = fit_calibration("toy-format", layers, [[0, 1]], keys, values, ones, ones, (0.5, 0.5))
    floor = cal.settings["floor_std"]
    assert floor == pytest.approx([0.1, 0.1])  # the file's floor (min_std 0.2, TRUNCATE_FRACTION) times the finest steps given
    for basis, f in zip(cal.keys + cal.values, floor + floor):
        assert bool((basis.variance.sqrt() >= f).all()) and basis.components < 16
    back = Calibration.from_bytes(cal.to_bytes())
    assert back.digest == cal.digest
    meta_len = int.from_bytes(cal.to_bytes()[:8], "little")
    header = json.loads(cal.to_bytes()[8:8 + meta_len])
    assert header["__metadata__"]["format"] == "kvcodec-kvtc-calibration-2"
    old = _with_format(cal.to_bytes(), "kvcodec-kvtc-calibration-1")
    assert Calibration.from_bytes(old).keys[0].components == cal.keys[0].components
    with pytest.raises(CorruptDataError, match="this kvcodec reads"):
        Calibration.from_bytes(_with_format(cal.to_bytes(), "kvcodec-kvtc-calibration-9"))


_FIT_IN_A_PROCESS = """
import torch
from kvcodec.codecs.kvtc.calibration import LayerInfo
from kvcodec.codecs.kvtc.fit import fit_calibration
g = torch.Generator().manual_seed(5)
x = torch.randn(300, 16, generator=g) @ torch.randn(16, 16, generator=g)
ones = [torch.ones(8)] * 2
cal = fit_calibration("toy-process", [LayerInfo(2, 4, 4, None)] * 2, [[0, 1]], list(x.split(8, 1)),
                      list((x * 2).split(8, 1)), ones, ones, (0.5, 0.5))
print(cal.digest)
"""


def test_the_same_fit_gives_the_same_bytes_in_every_process():
    """A calibration is named by its hash, so a fresh process must write the same bytes (safetensors orders its
    metadata differently from process to process; the header is written sorted)."""
    digests = {subprocess.run([sys.executable, "-c", _FIT_IN_A_PROCESS], capture_output=True, text=True, check=True,
                              timeout=120).stdout.strip() for _ in range(3)}
    assert len(digests) == 1 and len(digests.pop()) == 64


def _with_format(data: bytes, fmt: str) -> bytes:
    """The same safetensors file with another format string (the header re-encoded, padded as safetensors pads)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["format"] = fmt
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def test_a_container_written_with_a_format_1_calibration_still_decodes():
    """The golden kvtc container and calibration of format 1 (kept in tests/data when the golden files were
    regenerated for format 2) decode as they did: within SPEC's tolerance of the decode recorded then."""
    import kvcodec
    from kvcodec.codecs.kvtc import register_calibration
    from kvcodec.tools.kvtc_tolerance import assert_within_kvtc_tolerance

    data = Path(__file__).parent / "data" / "kvtc-format1"
    cal = register_calibration(data / "kvtc-calibration.kvtc")
    assert json.loads(cal.to_bytes()[8:8 + int.from_bytes(cal.to_bytes()[:8], "little")])["__metadata__"]["format"] \
        == "kvcodec-kvtc-calibration-1"
    blob = (data / "kvtc-f16.kvc").read_bytes()
    with kvcodec.open(blob) as r:
        assert r.info.config["calibration"] == cal.digest
    assert_within_kvtc_tolerance(blob, kvcodec.decode(blob), kvcodec.decode((data / "kvtc-f16.reference.kvc").read_bytes()))


def test_text_tokens_takes_the_same_share_of_each_calibration_text(smollm2):
    """``text_tokens`` keeps a mix balanced: each text gives at most that many tokens (here one 256-token segment
    each; the 44 left over are under a quarter segment and dropped), the sink token of each segment left out."""
    from kvcodec.codecs.kvtc.fit import collect_statistics
    from kvcodec.texts import load_text

    texts = ["license:Artistic", "license:Apache-2.0"]
    assert all(len(smollm2.tokenize(load_text(t))) > 1000 for t in texts)  # uncapped: several segments each
    stats = collect_statistics(smollm2, texts, segment_tokens=256, text_tokens=300)
    assert stats.settings["tokens"] == stats.keys[0].count == 2 * 255
