"""How a kvtc decoder finds a calibration: never in the working directory unless named, every file checked
against its hash and refused above a size limit before it is read, and a registry that stays bounded; how an
encoder finds its model's: by the model's identity, never by a name another model shares."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.codecs.kvtc import KVTC, Calibration, MissingCalibrationError
from kvcodec.codecs.kvtc import calibration as calmod
from kvcodec.codecs.kvtc.calibration import LayerInfo
from kvcodec.codecs.kvtc.fit import fit_calibration
from kvcodec.engines import auto_calibration
from kvcodec.errors import CorruptDataError, InvalidInputError, LimitExceededError

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
    monkeypatch.setattr(calmod, "_hashed", {})
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


# Two models served under one name (a fine-tune in a folder named like its base's), told apart by their identities.
BASE, TUNED = "a" * 32, "b" * 32


def test_a_name_shared_by_two_models_does_not_pick_the_others_calibration(fresh_process):
    base, tuned = _calibration(5).of_model(BASE), _calibration(6).of_model(TUNED)
    assert base.model == tuned.model == "toy-lookup"
    for cal in (base, tuned):
        calmod.install(cal)
    calmod._registered.clear()  # a later process: only what is installed
    assert calmod.calibration_for_model("toy-lookup") is None  # a name is ambiguous: never installed under it
    assert calmod.calibration_for_model(BASE).digest == base.digest
    assert calmod.calibration_for_model(TUNED).digest == tuned.digest
    # an encoder given a cache of the tuned model uses the tuned model's calibration...
    cache = SimpleNamespace(model="toy-lookup", model_digest=TUNED)
    assert KVTC().for_cache(cache).calibration == tuned.digest
    # ...and with only the base model's known (registered in this process, found by name), none: not the base's
    calmod._registered.clear()
    calmod.register_calibration(base)
    calmod.os.remove(calmod.os.path.join(calmod.cache_dir(), calmod._model_file(TUNED)))
    with pytest.raises(InvalidInputError, match=f"identity {TUNED}"):
        KVTC().for_cache(cache)


def test_a_calibration_made_before_identities_is_still_found_by_name(fresh_process):
    legacy = _calibration(7)
    assert legacy.model_digest == "" and legacy.model_key == "toy-lookup"
    calmod.install(legacy)
    calmod._registered.clear()
    assert calmod.calibration_for_model("toy-lookup").digest == legacy.digest
    # a cache with an identity falls back to it: it was made for that name before identities were recorded
    assert KVTC().for_cache(SimpleNamespace(model="toy-lookup", model_digest=BASE)).calibration == legacy.digest
    # the file's bytes are those it had before identities were recorded (containers name it by their hash)
    assert b"model_digest" not in legacy.to_bytes() and b"model_digest" in legacy.of_model(BASE).to_bytes()
    assert Calibration.from_bytes(legacy.of_model(BASE).to_bytes()).model_digest == BASE


def test_first_use_calibration_is_named_by_the_model_identity(fresh_process, monkeypatch):
    """An engine hook's first use installs the calibration under the identity its store carries (what `kvcodec
    calibrate --install` installs under), recording the model's name for humans; not under the engine's model
    path, which `kvcodec calibrate` never sees."""
    from kvcodec.codecs.kvtc import fit

    made = _calibration(8)
    monkeypatch.setattr(fit, "calibrate", lambda loaded, **options: made)  # the fit itself: test_kvtc_fit.py
    served = SimpleNamespace(model_id="toy-lookup")
    lines: list[str] = []
    assert auto_calibration.needs_first_calibration("kvtc", None, BASE)
    digest = auto_calibration.ensure_model_calibration(BASE, lambda: served, lines.append)
    calmod._registered.clear()
    found = calmod.calibration_for_model(BASE)
    assert found.digest == digest and found.model_digest == BASE and found.model == "toy-lookup"
    assert not auto_calibration.needs_first_calibration("kvtc", None, BASE)
    assert auto_calibration.needs_first_calibration("kvtc", None, TUNED)
    # a later start finds it without loading the model
    assert auto_calibration.ensure_model_calibration(BASE, lambda: pytest.fail("loaded the model"), lines.append) == digest


def test_calibrate_in_background_names_the_calibration_by_the_store_identity(fresh_process, monkeypatch):
    from kvcodec.codecs.kvtc import fit

    monkeypatch.setattr(fit, "calibrate", lambda loaded, **options: _calibration(9))
    switched = []
    store = SimpleNamespace(model="/srv/models/tuned", identity=SimpleNamespace(model_digest=TUNED),
                            codec=SimpleNamespace(codec_id="raw"), use_codec=switched.append)
    lines: list[str] = []
    auto_calibration.calibrate_in_background(store, lambda: SimpleNamespace(model_id="tuned"), lines.append).join(60)
    assert len(switched) == 1 and switched[0].calibration == calmod.calibration_for_model(TUNED).digest, lines
    assert calmod.calibration_for_model("/srv/models/tuned") is None


def test_damaged_side_data_is_corrupt_data(fresh_process):
    """A calibration fetched from a tier as side data raises CorruptDataError when it is damaged (so the store can
    evict it), also when its bytes hash to the name but hold a malformed calibration."""
    cal = _calibration(10)
    codec = KVTC(calibration=cal)
    data = bytearray(codec.side_data())
    data[len(data) // 2] ^= 1
    with pytest.raises(CorruptDataError, match="does not match its hash"):
        codec.install_side_data(bytes(data))
    # a file made to match the name a container records: layer indices that compare equal to ints but are not
    raw = cal.to_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = calmod.json.loads(raw[8:8 + n])
    layout = calmod.json.loads(header["__metadata__"]["layout"])
    layout["groups"] = [[float(i) for i in g] for g in layout["groups"]]
    header["__metadata__"]["layout"] = calmod.json.dumps(layout)
    text = calmod.json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    forged = len(text).to_bytes(8, "little") + text + raw[8 + n:]
    named = KVTC(calibration=calmod.hashlib.sha256(forged).hexdigest())
    with pytest.raises(CorruptDataError):
        named.install_side_data(forged)


def test_issue35_a_calibration_installed_under_another_name_is_found_by_its_content(fresh_process, monkeypatch):
    """A calibration copied into a folder of $KVCODEC_CALIBRATIONS under the name it was made with (not its hash)
    is found; each file there is hashed once per process, only when no file has the name, and a file over the
    size limit is never read."""
    cal = _calibration(11)
    blob = kvcodec.encode(_cache(), KVTC(calibration=cal))
    monkeypatch.setattr(calmod, "_registered", {})
    folder = fresh_process / "cals"
    folder.mkdir()
    (folder / "toy.kvtc").write_bytes(cal.to_bytes())
    (folder / "other.kvtc").write_bytes(_calibration(12).to_bytes())
    (folder / "notes.txt").write_bytes(cal.to_bytes())  # not a .kvtc file: not looked at
    with open(folder / "huge.kvtc", "wb") as f:  # sparse, over the limit: never read
        f.truncate(calmod.MAX_FILE_BYTES + 1)
    monkeypatch.setenv(calmod.ENV_PATH, str(folder))
    hashed = []
    real = calmod._file_sha256
    monkeypatch.setattr(calmod, "_file_sha256", lambda path: hashed.append(path) or real(path))
    assert kvcodec.decode(blob).num_layers == L
    assert sorted(map(calmod.os.path.basename, hashed)) == ["other.kvtc", "toy.kvtc"]
    # another miss in the same process hashes nothing again; a file named by its hash is found without hashing
    with pytest.raises(MissingCalibrationError, match="any name ending .kvtc"):
        calmod.find_calibration("0" * 64)
    named = _calibration(13)
    calmod.install(named, str(folder))
    assert calmod.find_calibration(named.digest).digest == named.digest
    assert len(hashed) == 2
    # a file that changes is hashed again (and the one installed since, once)
    (folder / "other.kvtc").write_bytes(named.to_bytes() + b" ")
    with pytest.raises(MissingCalibrationError):
        calmod.find_calibration("1" * 64)
    assert sorted(map(calmod.os.path.basename, hashed[2:])) == [named.digest + ".kvtc", "other.kvtc"]


def test_issue35_a_missing_calibration_file_is_named_as_missing(tmp_path):
    """``--codec kvtc:calibration=/missing.kvtc`` said the option must be 'auto', a SHA-256 or a file: now it says the
    file does not exist."""
    for missing in (str(tmp_path / "nope.kvtc"), "nope.kvtc", str(tmp_path / "sub" / "cal")):
        with pytest.raises(InvalidInputError, match=f"calibration file {missing} does not exist"):
            KVTC(calibration=missing)
    with pytest.raises(InvalidInputError, match="must be 'auto'"):
        KVTC(calibration="bogus")


def test_a_calibration_named_by_its_hash_is_found_without_hashing_the_others(fresh_process, monkeypatch):
    """The lookup by content is the fallback: it hashed every other ``*.kvtc`` file of the search path even when the
    file named by the digest was there and loaded."""
    folder = fresh_process / "cals"
    named = _calibration(14)
    calmod.install(named, str(folder))
    (folder / "other.kvtc").write_bytes(_calibration(15).to_bytes())
    monkeypatch.setattr(calmod, "_registered", {})
    monkeypatch.setenv(calmod.ENV_PATH, str(folder))
    hashed = []
    real = calmod._file_sha256
    monkeypatch.setattr(calmod, "_file_sha256", lambda path: hashed.append(path) or real(path))
    assert calmod.find_calibration(named.digest).digest == named.digest
    assert hashed == []
