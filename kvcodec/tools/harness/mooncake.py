"""Mooncake Store for the tests and benches: why it cannot run here (:func:`unavailable`), a real ``mooncake_master``
(:class:`Master`) and a segment holder (:class:`SegmentHolder`).

Mooncake keeps a value in the memory segment of the client that put it and drops it with that process, so engines
that come and go mount no segment (``mooncake://MASTER?segment=0``) and a :class:`SegmentHolder`, the segment holder
kvcodec ships (:mod:`kvcodec.store.tiers.mooncake_segment`) lending its memory to the store, keeps what they save."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcodec.errors import UnsupportedError
from kvcodec.store.tiers.mooncake_segment import READY
from kvcodec.tools.redis_server import free_port


def unavailable() -> str | None:
    """Why Mooncake Store cannot run in this environment (its client does not import, or it has no
    ``mooncake_master``), or None."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401  (also loads libibverbs.so.1)
        master_exe()
    except (ImportError, UnsupportedError) as e:
        return (f"Mooncake Store is unavailable in this environment ({e}): pip install -e '.[mooncake]' "
                "(scripts/setup.sh; scripts/setup_engines.sh in .venv-engines), which needs Debian's libibverbs1 "
                "and ibverbs-providers")
    return None


def master_exe() -> str:
    """The ``mooncake_master`` executable of the installed Mooncake; :class:`~kvcodec.errors.UnsupportedError`
    when there is none."""
    try:
        import mooncake
    except ImportError as e:
        raise UnsupportedError(f"Mooncake is not installed: {e}") from None
    for exe in (Path(sys.executable).parent / "mooncake_master", Path(mooncake.__file__).parent / "mooncake_master"):
        if exe.exists():
            return str(exe)
    raise UnsupportedError("mooncake_master is neither in the environment's bin nor in the mooncake package")


class Master:
    """A ``mooncake_master`` on free loopback ports (RPC and metrics/admin), its output in ``folder/master.log``;
    it can be paused, killed and restarted.  :meth:`start` raises :class:`~kvcodec.errors.UnsupportedError`
    without Mooncake and ``RuntimeError`` when the master does not listen within 15 s."""

    def __init__(self, folder: Path) -> None:
        self.rpc_port, self.admin_port, self.log = free_port(), free_port(), folder / "master.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def admin(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    def start(self) -> None:
        exe = master_exe()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [exe, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                 f"--metrics_port={self.admin_port}", "--metrics_host=127.0.0.1"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mooncake_master did not listen on {self.address} within 15 s")

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class SegmentHolder:
    """The segment holder kvcodec ships (``kvcodec mooncake-segment``) lending ``segment_bytes``
    of its memory to the Mooncake Store of ``master`` (``HOST:PORT``), its output in ``log`` (default: a temporary
    file); started when the constructor returns (``RuntimeError`` if it exits or has not mounted within 60 s).
    :meth:`stop` sends SIGTERM, as a deployment would, and records the exit status in ``returncode``."""

    def __init__(self, master: str, segment_bytes: int = 256 << 20, log: Path | None = None) -> None:
        if log is None:
            fd, name = tempfile.mkstemp(prefix="kvcodec-mooncake-segment-", suffix=".log")
            os.close(fd)
            log, self._own_log = Path(name), True
        else:
            self._own_log = False
        self.log, self.returncode = log, None
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvcodec", "mooncake-segment",
                                          f"mooncake://{master}?timeout=5", "--segment", str(segment_bytes)],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60  # the import and Mooncake's set-up take 2-4 s on a loaded 2-core machine
        while READY not in log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Mooncake segment holder did not mount its segment: "
                                   f"{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        if self._own_log:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> SegmentHolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
