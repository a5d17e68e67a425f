"""A store's estimates kept from one process to the next (kvcodec.store.telemetry_file): a fresh store plans its first
load on what the last one measured, within an age bound, and the file never costs a load or breaks a store."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest

from kvcodec.errors import InvalidInputError
from kvcodec.store import DenseSink, KVStore, MemoryTier
from kvcodec.store import telemetry_file as tf
from kvcodec.store.config import StoreConfig
from kvcodec.store.plan import LoadPlanner, Option
from kvcodec.store.telemetry import DECODE_PRIOR_TPS, LINK_PRIOR_BPS

MB = 1_000_000


def _store(path, *, tiers=None, codec=("kivi", "raw"), model="m") -> KVStore:
    return KVStore(tiers or [MemoryTier(name="cpu")], model=model, codec=list(codec), chunk_tokens=256,
                   telemetry_file=path)


def _plan(store: KVStore, tier: str = "cpu") -> tuple[float, float, float]:
    """The fresh planner's seconds to fetch 1 MB from ``tier`` and to decode 256 tokens of each variant."""
    planner = LoadPlanner(store.telemetry, store.variants)
    return (planner.fetch_s(Option(0, MB, tier)), planner.decode_s(Option(0, MB, tier), 256),
            planner.decode_s(Option(1, MB, tier), 256))


def _file(path, *, link_at: float, decode_at: float, machine: str | None = None) -> None:
    """A file measured by another process: the link at 2 MB/s, kivi decoding 256 tokens in 0.5 s."""
    store = _store(None)
    doc = {"format": tf.FORMAT,
           "links": {repr(store.tiers[0]): {"rate": 2e6, "at": link_at}},
           "machines": {machine or tf.machine(): {
               "decode": {repr(store.variants[0]): {"rate": 512.0, "at": decode_at}}, "contention": {}}}}
    path.write_text(json.dumps(doc))


def test_a_fresh_store_plans_its_first_load_on_what_the_last_one_measured(tmp_path, real_kv):
    path = tmp_path / "m.json"
    first = _store(path, model=real_kv.model)
    ids = list(range(real_kv.num_tokens))
    first.put(ids, real_kv)
    assert first.prefix_load(ids, DenseSink()).start().finish().complete
    measured = _plan(first)
    first.close()
    assert measured[0] != MB / LINK_PRIOR_BPS and measured[2] != 256 / DECODE_PRIOR_TPS  # it did measure

    fresh = _store(path, model=real_kv.model)
    assert _plan(fresh) == pytest.approx(measured)
    assert LoadPlanner(fresh.telemetry, fresh.variants).decode_known(Option(1, MB, "cpu"))
    assert _plan(_store(None)) == (MB / LINK_PRIOR_BPS, 256 / DECODE_PRIOR_TPS, 256 / DECODE_PRIOR_TPS)
    fresh.close()


def test_what_a_fresh_store_restored_is_said_in_a_line_for_the_engine_log(tmp_path):
    path = tmp_path / "m.json"
    assert _store(path).telemetry_file.restored is None  # no file yet: nothing restored, nothing to say
    _file(path, link_at=time.time() - 30, decode_at=time.time() - 60)
    line = _store(path).telemetry_file.restored
    assert line.startswith(f"kvcodec: the store starts from the estimates in {path}: link cpu 16.0 Mbit/s (")
    assert line.endswith("s old); decode rates of 1 variant(s)"), line


def test_fresh_measurements_replace_restored_ones(tmp_path):
    path = tmp_path / "m.json"
    _file(path, link_at=time.time(), decode_at=time.time())
    store = _store(path)
    assert _plan(store)[:2] == pytest.approx((0.5, 0.5))
    store.telemetry.observe_read("cpu", 100 * MB, 1.0)  # the link rose: its first read replaces the restored rate
    assert _plan(store)[0] == pytest.approx(0.01)
    kivi = store.telemetry.decode_rate(store.variants[0])
    for _ in range(kivi.window):  # a decode rate is a sample, pushed out by a window of decodes
        kivi.observe(256, 0.1)
    assert _plan(store)[1] == pytest.approx(0.1)
    store.close()


@pytest.mark.parametrize("link_age, decode_age, machine, restored", [
    (10, 10, None, (0.5, 0.5)),
    (tf.LINK_MAX_AGE_S + 10, 10, None, (MB / LINK_PRIOR_BPS, 0.5)),
    (10, tf.MACHINE_MAX_AGE_S + 10, None, (0.5, 256 / DECODE_PRIOR_TPS)),
    (-3600, -3600, None, (MB / LINK_PRIOR_BPS, 256 / DECODE_PRIOR_TPS)),  # dated an hour ahead: not believed
    (10, 10, "another machine", (0.5, 256 / DECODE_PRIOR_TPS)),  # a link is the tier's, a decode rate the machine's
])
def test_stale_entries_and_other_machines_decode_rates_are_ignored(tmp_path, link_age, decode_age, machine,
                                                                     restored):
    path = tmp_path / "m.json"
    now = time.time()
    _file(path, link_at=now - link_age, decode_at=now - decode_age, machine=machine)
    store = _store(path)
    assert _plan(store)[:2] == pytest.approx(restored)
    store.close()


def test_a_tier_is_known_by_where_it_is_not_by_its_name(tmp_path):
    path = tmp_path / "m.json"
    a, b = MemoryTier(name="cpu"), MemoryTier(name="remote")
    store = _store(path, tiers=[a, b])
    store.telemetry.observe_read("remote", 4 * MB, 1.0)
    store.close()
    again = _store(path, tiers=[MemoryTier(name="cpu"), MemoryTier(name="remote")])
    assert _plan(again, "remote")[0] == pytest.approx(0.25) and _plan(again, "cpu")[0] == MB / LINK_PRIOR_BPS
    assert list(json.loads(path.read_text())["links"]) == ["MemoryTier(name='remote')"]
    again.close()


@pytest.mark.parametrize("content", [b"{\"format\": \"kvcodec-telemetry/1\", \"links\": {", b"[1, 2, 3]",
                                     b"{\"format\": \"something else\"}", b"[" * 100_000, b"\xff\xfe binary",
                                     b" " * (tf.MAX_FILE_BYTES + 1) + b"{}"],
                         ids=["torn", "a list", "foreign", "deep", "binary", "huge"])
def test_a_file_that_is_not_ours_is_ignored_with_one_warning_and_left_as_it_is(tmp_path, caplog, content):
    path = tmp_path / "m.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="kvcodec.store.telemetry_file"):
        store = _store(path)
        assert _plan(store)[0] == MB / LINK_PRIOR_BPS
        store.telemetry.observe_read("cpu", MB, 1.0)
        assert not store.telemetry_file.save()
        store.close()
    assert len(caplog.records) == 1 and str(path) in caplog.text
    assert path.read_bytes() == content


def test_a_fifo_at_the_path_does_not_hang_the_store(tmp_path, caplog):
    path = tmp_path / "m.json"
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING, logger="kvcodec.store.telemetry_file"):
        _store(path).close()
    assert "not a regular file" in caplog.text


def test_bad_entries_are_skipped_and_the_rest_used(tmp_path):
    path = tmp_path / "m.json"
    _file(path, link_at=time.time(), decode_at=time.time())
    doc = json.loads(path.read_text())
    doc["links"]["MemoryTier(name='elsewhere')"] = {"rate": -1, "at": time.time()}
    doc["links"]["x" * (tf.MAX_KEY_CHARS + 1)] = {"rate": 1.0, "at": time.time()}
    doc["machines"][tf.machine()]["decode"]["NaN rate"] = {"rate": "fast", "at": None}
    doc["machines"][tf.machine()]["contention"] = {"MemoryTier(name='cpu')": {"pairs": [[1, "x"]], "at": 0}}
    path.write_text(json.dumps(doc))
    store = _store(path)
    assert _plan(store)[:2] == pytest.approx((0.5, 0.5))
    store.telemetry.observe_read("cpu", MB, 1.0)
    assert store.telemetry_file.save()
    kept = json.loads(path.read_text())
    assert list(kept["links"]) == ["MemoryTier(name='cpu')"] and kept["links"]["MemoryTier(name='cpu')"]["rate"] == MB
    store.close()


def test_contention_is_kept_per_machine_and_tier(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    store = _store(path)
    link = store.telemetry.link("cpu")
    link.contention.observe(MB, 1.0, beside_decode=False)
    link.contention.observe(MB, 2.0, beside_decode=True)  # a read beside a decode took twice as long
    assert link.contention.slowdown(MB) == 2.0
    store.close()
    again = _store(path)
    assert again.telemetry.link("cpu").contention.slowdown(MB) == 2.0
    again.close()


def test_the_file_is_bounded(tmp_path):
    path = tmp_path / "m.json"
    store = _store(path)
    for i in range(3 * tf.MAX_ENTRIES):
        store.telemetry.decode_rate(f"codec {i}").observe(256, 1.0 + i)
    store.close()
    decode = json.loads(path.read_text())["machines"][tf.machine()]["decode"]
    assert len(decode) == tf.MAX_ENTRIES and "codec 0" not in decode  # the newest kept
    assert path.stat().st_size < tf.MAX_FILE_BYTES


def test_observations_never_write_the_file_the_saver_does_every_few_seconds(tmp_path, monkeypatch):
    monkeypatch.setattr(tf, "SAVE_EVERY_S", 0.05)
    writers: list[str] = []
    real = tf.write_atomically

    def counted(path, data):
        writers.append(threading.current_thread().name)
        real(path, data)

    monkeypatch.setattr(tf, "write_atomically", counted)
    store = _store(tmp_path / "m.json")
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.5:
        store.telemetry.observe_read("cpu", MB, 0.02 + n * 1e-9)  # (longer than a round trip: each measures)
        n += 1
    took = time.perf_counter() - t0
    store.close()
    assert n > 1000
    assert len(writers) <= took / 0.05 + 2, (n, writers)
    assert writers[:-1] and set(writers[:-1]) == {"kvcodec-telemetry-file"}  # the last is close()'s
    assert json.loads((tmp_path / "m.json").read_text())["links"]["MemoryTier(name='cpu')"]["rate"] > 0


def test_concurrent_writers_never_tear_the_file(tmp_path):
    path = tmp_path / "m.json"
    stores = [_store(path, tiers=[MemoryTier(name=f"t{i}")]) for i in range(4)]
    stop, seen, torn = threading.Event(), [], []

    def read() -> None:
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                seen.append(json.loads(text)["format"])
            except ValueError:
                torn.append(text)

    def write(i: int) -> None:
        for k in range(30):
            stores[i].telemetry.observe_read(f"t{i}", MB * (k + 1), 1.0)
            stores[i].telemetry_file.save()

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert not torn and seen and set(seen) == {tf.FORMAT}
    for i, store in enumerate(stores):  # one after another, each write keeps the others' entries
        store.telemetry.observe_read(f"t{i}", 100 * MB, 1.0)
        store.close()
    links = json.loads(path.read_text())["links"]
    assert {k: v["rate"] for k, v in links.items()} == {
        f"MemoryTier(name='t{i}')": pytest.approx(s.telemetry.link(f"t{i}").throughput.estimate)
        for i, s in enumerate(stores)}


def test_the_setting_turns_it_off_or_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv(tf.DIR_ENV, str(tmp_path / "folder"))
    assert KVStore([MemoryTier()], model="m").telemetry_file is None  # a bare store keeps nothing
    auto = StoreConfig().store(model="org/model")
    assert auto.telemetry_file.path == tf.default_path("org/model")
    assert auto.telemetry_file.path.startswith(str(tmp_path / "folder"))
    assert tf.default_path("org/model", "tenant") != tf.default_path("org/model")
    assert StoreConfig(telemetry="off").store(model="m").telemetry_file is None
    assert StoreConfig(telemetry=str(tmp_path / "x.json")).store(model="m").telemetry_file.path == \
        str(tmp_path / "x.json")
    config, _ = StoreConfig.parse({"telemetry": "off"})
    assert config.telemetry == "off"
    for bad in ("", False, 3):
        with pytest.raises(InvalidInputError, match="'telemetry'"):
            StoreConfig(telemetry=bad)
    auto.close()


def test_a_store_dropped_without_closing_takes_its_saver_thread_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tf, "SAVE_EVERY_S", 0.02)
    store = _store(tmp_path / "m.json")
    thread = store.telemetry_file._thread
    assert thread.is_alive()
    del store
    thread.join(5)
    assert not thread.is_alive()


def test_a_file_that_cannot_be_written_warns_once_and_the_store_goes_on(tmp_path, caplog, monkeypatch):
    def full(path, data):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(tf, "write_atomically", full)
    store = _store(tmp_path / "m.json")
    with caplog.at_level(logging.WARNING, logger="kvcodec.store.telemetry_file"):
        for i in range(3):
            store.telemetry.observe_read("cpu", MB * (i + 1), 1.0)
            assert not store.telemetry_file.save()
        store.close()
    assert len(caplog.records) == 1 and "could not be written" in caplog.text
    assert _plan(store)[0] == pytest.approx((1 / 1 + 1 / 2 + 1 / 3) / 3)  # measuring went on


def test_a_read_as_short_as_a_round_trip_never_lowers_the_link_estimate():
    """Inside vLLM a 230 KB GET took 4.9 ms on a 600 MB/s link (47 MB/s by its time): a fresh engine's first load,
    planning on that, took kvtc for half its chunks.  A read shorter than ROUND_TRIP_S that looks slower than the
    estimate says only that a request has a round trip; a longer one, or a faster one, measures the link."""
    from kvcodec.store.telemetry import ROUND_TRIP_S, Link

    link = Link(600e6)
    link.observe(230_000, 0.0049)
    assert link.throughput.estimate == 600e6 and not link.throughput.samples
    link.observe(4_000_000, 0.004)  # faster than the estimate: a rise shows at once however short the read
    assert link.throughput.estimate == pytest.approx(1e9)
    link.observe(256 << 10, 2 * ROUND_TRIP_S)  # a slower link shows in a longer read
    slow = (256 << 10) / (2 * ROUND_TRIP_S)
    assert link.throughput.estimate == pytest.approx(2 / (1 / 1e9 + 1 / slow)) and link.throughput.estimate < 2 * slow


def test_the_engines_prefill_speed_is_kept_for_a_fresh_engines_first_load(tmp_path):
    """A load stops where the engine recomputing the rest is sooner, and a fusion computes its first segments
    while the rest load, only once the engine's prefill speed is known.  Inside vLLM a fresh engine's first
    request did not know it (its worker times steps without loads): at 100 Mbit/s it loaded every raw segment,
    1.20x a full prefill.  The speed is now kept with the store's estimates, as the machine's."""
    path = tmp_path / "m.json"
    first = _store(path)
    assert not first.telemetry.prefill.samples  # never planned with before a step is timed
    first.telemetry.prefill.observe(4000, 10.0)
    first.close()
    fresh = _store(path)
    assert fresh.telemetry.prefill.samples and fresh.telemetry.prefill.estimate == pytest.approx(400)
    assert fresh.telemetry_file.restored.endswith("; prefill 400 tokens/s"), fresh.telemetry_file.restored
    fresh.close()
    doc = json.loads(path.read_text())
    assert doc["machines"][tf.machine()]["prefill"][tf.ENGINE]["rate"] == pytest.approx(400)
    doc["machines"] = {"another machine": doc["machines"][tf.machine()]}  # a prefill speed is the machine's
    path.write_text(json.dumps(doc))
    other = _store(path)
    assert not other.telemetry.prefill.samples
    other.close()
