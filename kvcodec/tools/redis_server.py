"""A real redis-server for tests and benches: on a free loopback port (or behind a shaped link, in its namespace),
in its own folder, without persistence; it can be killed, frozen and restarted."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from kvcodec.errors import UnsupportedError


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server in its own folder, without persistence, that can be killed and restarted: on a loopback port,
    or inside a :class:`~kvcodec.tools.netlab.ShapedLink`'s namespace, reached through its shaper."""

    def __init__(self, exe: str, folder: Path, link: Any = None) -> None:
        self.exe, self.folder, self.link = exe, folder, link
        self.host, self.port = (link.peer, 6379) if link is not None else ("127.0.0.1", free_port())
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def start(self) -> None:
        cmd = [self.exe, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
               "--dir", str(self.folder), "--daemonize", "no", "--protected-mode", "no"]
        self.proc = subprocess.Popen(cmd if self.link is None else self.link.command(*cmd),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within 10 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill it, also when it is frozen."""
        if self.proc is not None:
            self.resume()
        self.kill()


def started_redis(folder: Path, link: Any = None) -> RedisServer:
    """A started :class:`RedisServer` in ``folder`` (behind ``link`` when given).

    Raises :class:`~kvcodec.errors.UnsupportedError` naming what to install when redis-server or the redis
    package is missing."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise UnsupportedError("redis-server is not on PATH: the store and engine tests and the benches need a real "
                               "Redis. Install it (Debian: apt-get install -y redis-server; scripts/setup.sh does it "
                               "when run as root)")
    try:
        import redis  # noqa: F401
    except ImportError:
        raise UnsupportedError("the redis Python package is missing: pip install -e '.[redis]' "
                               "(scripts/setup.sh does it)") from None
    server = RedisServer(exe, folder, link)
    server.start()
    return server
