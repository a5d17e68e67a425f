"""A real network link of a rate the caller sets, for the store's remote tiers (tests and benches).

A network namespace of the caller's own is joined to this one by a veth pair; the kernel's token-bucket shaper
(``tc ... tbf``) on each end limits what leaves that end, so both directions run at ``rate``.  A server started
with :meth:`ShapedLink.command` listens inside the namespace at :attr:`ShapedLink.peer`, and clients here reach
it over real TCP through the shaper; :meth:`ShapedLink.set_rate` changes the rate mid-run, and
:meth:`ShapedLink.playing` replays a bandwidth trace in real time (:func:`jitter_walk` makes a seeded one).  Needs root (namespaces and qdiscs); ``netem`` is not in these kernels, so there is no added delay or loss.
Traffic goes only to the namespace's own address, and the namespace and its link are deleted on exit, also
after a failure.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence

_made = itertools.count()


def unavailable() -> str | None:
    """Why a shaped link cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a shaped link needs root (a network namespace and tc qdiscs); CI runs as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"a shaped link needs {' and '.join(missing)} (Debian: apt-get install -y iproute2)"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class ShapedLink:
    """A namespace at :attr:`peer` reached over a veth pair shaped to ``rate_mbit`` in both directions."""

    def __init__(self, rate_mbit: float) -> None:
        n = next(_made)
        tag = f"{os.getpid() % 100000}{n}"
        # a /30 of its own per link and process, so that parallel runs (CI, other sessions) never share one
        net = (os.getpid() * 7 + n) % 4096
        prefix = f"10.{200 + net // 256 % 50}.{net % 256}"
        self.namespace, self.host_dev, self.peer_dev = f"kvcodec-{tag}", f"kvh{tag}", f"kvp{tag}"
        self.host, self.peer = f"{prefix}.1", f"{prefix}.2"
        self.rate_mbit = rate_mbit
        self._shaped = False

    def __enter__(self) -> ShapedLink:
        try:
            _run("ip", "netns", "add", self.namespace)
            _run("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.peer_dev)
            _run("ip", "link", "set", self.peer_dev, "netns", self.namespace)
            _run("ip", "addr", "add", f"{self.host}/30", "dev", self.host_dev)
            _run("ip", "link", "set", self.host_dev, "up")
            inside = ("ip", "netns", "exec", self.namespace)
            _run(*inside, "ip", "addr", "add", f"{self.peer}/30", "dev", self.peer_dev)
            _run(*inside, "ip", "link", "set", self.peer_dev, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            self.set_rate(self.rate_mbit)
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, rate_mbit: float) -> None:
        """Shape both ends to ``rate_mbit``; takes effect at once, also on transfers in flight."""
        # a burst of 10 ms at the rate, but never under 128 KiB: the veth pair hands the shaper 64 KiB GSO packets,
        # and after a "change" tbf holds one larger than its burst at the head of its queue for ever
        burst = max(128 << 10, int(rate_mbit * 1e6 / 8 / 100))
        # "change" keeps the packets queued in the shaper (a new qdisc would drop them, and TCP would back off); a
        # short queue (50 ms at the rate) keeps a rate drop from leaving seconds of data queued ahead of a reply
        shape = ("tc", "qdisc", "change" if self._shaped else "add", "dev")
        spec = ("root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms")
        _run(*shape, self.host_dev, *spec)
        _run("ip", "netns", "exec", self.namespace, *shape, self.peer_dev, *spec)
        self.rate_mbit, self._shaped = rate_mbit, True

    @contextlib.contextmanager
    def playing(self, steps: Sequence[tuple[float, float]]) -> Iterator[None]:
        """Within the block, the link follows ``steps``, ``(seconds into the block, Mbit/s)`` (the first at 0): a
        bandwidth trace replayed in real time, stopped where the block ends."""
        self.set_rate(steps[0][1])
        stop = threading.Event()

        def play() -> None:
            t0 = time.monotonic()
            for at, mbit in steps[1:]:
                if stop.wait(max(0.0, t0 + at - time.monotonic())):
                    return
                self.set_rate(mbit)

        player = threading.Thread(target=play, daemon=True)
        player.start()
        try:
            yield
        finally:
            stop.set()
            player.join()

    def command(self, *args: str) -> list[str]:
        """``args`` as a command that runs inside the namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def close(self) -> None:
        for args in (("ip", "link", "del", self.host_dev), ("ip", "netns", "del", self.namespace)):
            subprocess.run(args, capture_output=True, timeout=30)

    def __exit__(self, *exc: object) -> None:
        self.close()


def jitter_walk(seed: int = 0, seconds: float = 120, step_s: float = 0.2, low: float = 20,
                high: float = 2000) -> list[tuple[float, float]]:
    """``(seconds, Mbit/s)`` steps for :meth:`ShapedLink.playing`: a new rate every ``step_s``, a seeded random walk
    in log-rate (each step up or down by a factor of up to 4, reflected at ``low`` and ``high``) from their
    geometric middle."""
    rng = random.Random(seed)
    lo, hi = math.log(low), math.log(high)
    x, steps = (lo + hi) / 2, []
    for i in range(int(seconds / step_s)):
        steps.append((round(i * step_s, 3), round(math.exp(x), 1)))
        x += rng.uniform(-math.log(4), math.log(4))
        x = lo + abs(x - lo) if x < lo else hi - abs(x - hi) if x > hi else x
    return steps
