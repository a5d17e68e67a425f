"""How a kvtc decoder finds a calibration: never in the working directory unless named, every file checked
against its hash and refused above a size limit before it is read, and a registry that stays bounded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.codecs.kvtc import KVTC, Calibration, MissingCalibrationError
from kvcodec.codecs.kvtc import calibration as calmod
from kvcodec.codecs.kvtc.calibration import LayerInfo
from kvcodec.tools.kvtc_calibration import fit_calibration
from kvcodec.errors import LimitExceededError

L, H, D = 2, 1, 4


def _calibration(seed: int) -> Calibration:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(200, H * D, generator=g) for _ in range(2 * L)]
    ones = [torch.ones(H * D) for _ in range(L)]
    return fit_calibration("toy-lookup", [LayerInfo(H, D, D, None) for _ in range(L)], [[0, 1]], rows[:L], rows[L:],
                           ones, ones, (0.01, 0.01))


def _cache() -> kvcodec.KVCache:
    g = torch.Generator().manual_seed(7)
    return kvcodec.KVCache([(torch.randn(H, 12, D, generator=g), torch.randn(H, 12, D, generator=g))
                            for _ in range(L)], model="toy-lookup", rope="post")


@pytest.fixture()
def fresh_process(tmp_path, monkeypatch):
    """No calibration registered, an empty cache folder and no $KVCODEC_CALIBRATIONS: a new machine."""
    monkeypatch.setattr(calmod, "_registered", {})
    monkeypatch.setattr(calmod, "_pinned", set(), raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(calmod.ENV_PATH, raising=False)
    return tmp_path


def test_a_file_named_by_the_hash_in_the_working_directory_is_not_used(fresh_process, monkeypatch):
    right, impostor = _calibration(1), _calibration(2)
    blob = kvcodec.encode(_cache(), KVTC(calibration=right))
    monkeypatch.setattr(calmod, "_registered", {})
    work = fresh_process / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    # a calibration of the same shapes under the name the container records, with and without the suffix
    for name in (right.digest, right.digest + calmod.SUFFIX):
        (work / name).write_bytes(impostor.to_bytes())
    with pytest.raises(MissingCalibrationError, match=right.digest):
        kvcodec.decode(blob)
    assert impostor.digest not in calmod._registered
    # the working directory, named explicitly, is searched; a file there that does not hash to its name is passed
    # over (a fault of this machine, not of the container: not corrupt data) and the search goes on
    other = fresh_process / "other"
    calmod.install(right, str(other))
    monkeypatch.setenv(calmod.ENV_PATH, str(work))
    with pytest.raises(MissingCalibrationError, match="passed over .*does not match its hash"):
        kvcodec.decode(blob)
    monkeypatch.setenv(calmod.ENV_PATH, calmod.os.pathsep.join([str(work), str(other)]))
    assert kvcodec.decode(blob).num_layers == L


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert calmod.cache_dir().startswith(calmod.os.path.expanduser("~"))


def test_an_oversized_calibration_file_is_refused_before_it_is_read(fresh_process, monkeypatch):
    cal = _calibration(3)
    blob = kvcodec.encode(_cache(), KVTC(calibration=cal))
    monkeypatch.setattr(calmod, "_registered", {})
    folder = fresh_process / "cals"
    folder.mkdir()
    path = folder / (cal.digest + calmod.SUFFIX)
    with open(path, "wb") as f:  # sparse: a file of nothing over the limit, as a broken or hostile peer could leave
        f.truncate(2 << 20)
    monkeypatch.setattr(calmod, "MAX_FILE_BYTES", 1 << 20, raising=False)
    monkeypatch.setenv(calmod.ENV_PATH, str(folder))
    with pytest.raises(MissingCalibrationError, match="passed over .* over the limit of 1048576"):
        kvcodec.decode(blob)
    with pytest.raises(LimitExceededError, match="over the limit"):
        Calibration.load(path, cal.digest)
    # the limit is the caller's to set, and a file within it loads
    path.write_bytes(cal.to_bytes())
    size = len(cal.to_bytes())
    with pytest.raises(LimitExceededError):
        Calibration.load(path, cal.digest, max_bytes=size - 1)
    assert Calibration.load(path, cal.digest, max_bytes=size).digest == cal.digest


def test_the_registry_keeps_a_few_found_calibrations_and_every_registered_one(fresh_process, monkeypatch):
    folder = fresh_process / "cals"
    monkeypatch.setenv(calmod.ENV_PATH, str(folder))
    base = _calibration(4)
    cals = [dataclasses.replace(base, settings={"copy": i}, _bytes=None) for i in range(calmod.MAX_FOUND + 3)]
    for cal in cals:
        calmod.install(cal, str(folder))
    pinned = calmod.register_calibration(dataclasses.replace(base, settings={"copy": "pinned"}, _bytes=None))
    for cal in cals:
        assert calmod.find_calibration(cal.digest).digest == cal.digest
    assert set(calmod._registered) == {pinned.digest} | {c.digest for c in cals[-calmod.MAX_FOUND:]}
    # a lookup refreshes a found calibration: the least recently used one goes first
    calmod.find_calibration(cals[-calmod.MAX_FOUND].digest)
    calmod.find_calibration(cals[0].digest)
    assert cals[-calmod.MAX_FOUND].digest in calmod._registered
    assert cals[-calmod.MAX_FOUND + 1].digest not in calmod._registered
    assert calmod.find_calibration(pinned.digest) is pinned
    # explicitly registered calibrations are never dropped: the caller chose them
    many = [calmod.register_calibration(dataclasses.replace(base, settings={"reg": i}, _bytes=None))
            for i in range(calmod.MAX_FOUND + 2)]
    assert all(c.digest in calmod._registered for c in many + [pinned])
    assert np.array_equal(calmod.find_calibration(many[0].digest).keys[0].basis, base.keys[0].basis)
