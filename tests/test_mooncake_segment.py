"""The Mooncake segment holder kvcodec ships (``kvcodec mooncake-segment``): against a real
mooncake_master it lends the memory an engine-like client (``segment=0``) stores into, and unmounts on SIGTERM or
SIGINT with exit 0; a master that is not there, a bad size or a URL the flags contradict is one clear line.  The
URL it builds from the engines' URL is checked without Mooncake."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from kvcodec.errors import InvalidInputError
from kvcodec.store.tiers.mooncake_segment import READY, add_arguments, holder_url
from kvcodec.tools.harness.mooncake import Master, SegmentHolder, unavailable
from kvcodec.tools.redis_server import free_port

HOLDER = [sys.executable, "-m", "kvcodec", "mooncake-segment"]
SEGMENT = 64 << 20
# Python's import of kvcodec (torch) and Mooncake's set-up take 2-4 s here; a bound well above that still catches
# a hang (Mooncake's set-up blocks 90 s without a master)
BOUND_S = 30


@pytest.fixture(scope="module")
def mooncake() -> None:
    why = unavailable()
    if why:
        if os.environ.get("CI"):  # CI installs Mooncake: missing there is a broken set-up, not a skip
            pytest.fail(why, pytrace=False)
        pytest.skip(why)


@pytest.fixture()
def master(mooncake, tmp_path):
    m = Master(tmp_path)
    m.start()
    yield m
    m.kill()


def _segments(master: Master) -> list[str]:
    with urllib.request.urlopen(f"http://{master.admin}/get_all_segments", timeout=5) as r:
        return r.read().decode().split()


def _text() -> bytes:
    return "\n".join(topics[k] for k in sorted(topics)[:40]).encode()  # real text, about 200 KB


def _wait_ready(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + BOUND_S
    while True:
        lines = [line for line in log.read_text(errors="replace").splitlines() if READY in line]
        if lines:
            return lines[0]
        assert proc.poll() is None, f"the holder exited with {proc.returncode}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"the holder did not mount within {BOUND_S} s: {log.read_text()[-2000:]}"
        time.sleep(0.05)


def test_holder_keeps_what_a_client_lending_nothing_stores(master, tmp_path):
    from kvcodec.store.tiers import tier_from_url

    engine_url = f"mooncake://{master.address}?segment=0&timeout=5"
    engine = tier_from_url(engine_url)  # as an engine's tier: it lends no memory
    value = _text()
    try:
        assert engine.available
        assert not engine.put("prompt", value), "with no segment anywhere, Mooncake has nowhere to put it"
        log = tmp_path / "holder.log"
        with open(log, "wb") as out:  # the engines' own URL, with the size to lend
            holder = subprocess.Popen([*HOLDER, engine_url, "--segment", "64MiB"], stdout=out, stderr=subprocess.STDOUT)
        try:
            line = _wait_ready(holder, log)
            assert "64 MiB" in line and master.address in line and "tcp" in line
            assert len(_segments(master)) == 1
            assert engine.put("prompt", value)
            assert engine.get("prompt") == value
            holder.send_signal(signal.SIGTERM)
            assert holder.wait(BOUND_S) == 0
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
        assert _segments(master) == [], "the holder left its segment mounted (a killed one's stays listed)"
        assert engine.get("prompt") is None, "the value outlived the memory that held it"
    finally:
        engine.close()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_holder_unmounts_and_exits_0_on_a_stop_signal(master, tmp_path, stop):
    holder = SegmentHolder(master.address, SEGMENT, log=tmp_path / "holder.log")  # the harness runs the module
    try:
        assert len(_segments(master)) == 1
        t = time.monotonic()
        holder.proc.send_signal(stop)
        assert holder.proc.wait(BOUND_S) == 0
        took = time.monotonic() - t
    finally:
        holder.stop()
    assert took < 10, f"the holder took {took:.1f} s to stop (Mooncake's close takes 1-2 s)"
    assert "unmounting 64 MiB" in holder.log.read_text()
    assert _segments(master) == []


def test_master_not_there_is_one_line_within_the_wait(mooncake):
    address = f"127.0.0.1:{free_port()}"
    t = time.monotonic()
    got = subprocess.run([*HOLDER, address, "--segment", "64MiB", "--wait", "1"], capture_output=True, text=True,
                         timeout=BOUND_S)
    took = time.monotonic() - t
    assert got.returncode == 4  # the kvcodec command's status for I/O
    assert got.stdout == ""
    [line] = got.stderr.splitlines()
    assert f"the Mooncake master at {address} did not take it within 1 s" in line and "Connection refused" in line
    assert took < 15, f"giving up took {took:.1f} s with --wait 1"


@pytest.mark.parametrize("argv, says", [
    (["--segment", "0"], "a holder lends more than 0 bytes"),
    (["--segment", "lots"], "'lots' is not a size"),
    (["--segment", "100000TiB"], "more than this machine's"),
    ([], "give --segment SIZE"),
    (["--segment", "1GiB", "--wait", "-1"], "not a number of seconds"),
])
def test_bad_arguments_are_one_error_line_and_exit_2(argv, says):
    got = subprocess.run([*HOLDER, "127.0.0.1:50051?segment=0", *argv], capture_output=True, text=True,
                         timeout=BOUND_S)
    assert got.returncode == 2
    assert says in got.stderr.splitlines()[-1]
    assert "Traceback" not in got.stderr


def _url(*argv: str) -> str:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return holder_url(parser.parse_args(list(argv)))


def test_holder_url_is_the_engines_url_with_what_the_holder_lends():
    from urllib.parse import parse_qs, urlsplit

    url = urlsplit(_url("mooncake://10.0.0.5:50051?segment=0&buffer=256MiB&local=10.0.0.7&admin=10.0.0.5:9003",
                        "--segment", "8GiB", "--local", "10.0.0.6"))
    assert url.netloc == "10.0.0.5:50051"
    assert {k: v[-1] for k, v in parse_qs(url.query).items()} == {
        "segment": str(8 << 30), "buffer": "1MiB", "local": "10.0.0.6", "admin": "10.0.0.5:9003"}
    assert urlsplit(_url("10.0.0.5", "--segment", "1GiB", "--metadata", "http://10.0.0.5:8080/metadata")).query == (
        "metadata=http%3A%2F%2F10.0.0.5%3A8080%2Fmetadata&segment=1073741824&buffer=1MiB")
    assert "segment=512MiB" in _url("mooncake://h?segment=512MiB")  # the URL's own size, when above 0


@pytest.mark.parametrize("argv, says", [
    (["mooncake://h?protocol=rdma", "--protocol", "tcp", "--segment", "1GiB"], "contradicts the URL's protocol"),
    (["mooncake://h?metadata=P2PHANDSHAKE", "--metadata", "http://m/metadata", "--segment", "1GiB"],
     "contradicts the URL's metadata"),
    (["redis://h", "--segment", "1GiB"], "is not a Mooncake URL"),
    (["mooncake://h?segment=0"], "give --segment SIZE"),
])
def test_holder_url_refuses_what_it_cannot_lend_as_asked(argv, says):
    with pytest.raises(InvalidInputError, match=says):
        _url(*argv)
