"""A Mooncake segment holder: the long-lived process that lends its memory to a Mooncake Store, so that what
engines save outlives them.

Mooncake keeps a value in the memory segment of the client that put it and drops it when that client exits.
Engines come and go, so their Mooncake tier lends nothing (``mooncake://MASTER?segment=0``) and their puts land
in the segments of holders like this one: run one on each machine that lends memory, beside a ``mooncake_master``.

``kvcodec mooncake-segment URL --segment SIZE`` runs it (:mod:`kvcodec.cli` wires :func:`add_arguments` and
:func:`run`, and maps its errors to the command's exit statuses).  The URL is the engines' own
tier URL (:mod:`kvcodec.store.tiers.urls`), so the holder and the engines name the master, metadata server and
protocol the same way; ``--segment`` and ``--local`` replace its ``segment=`` (the engines' says 0) and ``local=``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvcodec.errors import InvalidInputError, UnsupportedError
from kvcodec.store.tiers.urls import parse_size, tier_from_url

log = logging.getLogger(__name__)

DEFAULT_WAIT_S = 10.0
# The holder puts and gets nothing itself, and Mooncake registers a client's transfer buffer whole: a small one
# keeps the holder's memory what it lends (the engines' URL may ask for hundreds of MiB).
HOLDER_BUFFER = "1MiB"
POLL_S = 0.2
READY = "mooncake-segment: lending"  # how the one line saying what is lent begins (scripts wait for it)

HELP = "lend memory to a Mooncake Store: where engines' Mooncake tier (segment=0) keeps what it saves"
DESCRIPTION = """\
Lend SIZE bytes of this machine's memory to a Mooncake Store and hold them until stopped (SIGTERM or
Ctrl-C unmounts the segment and exits 0).

Why: Mooncake keeps each value in the memory of the client that put it, and drops it when that client
exits. Engines come and go, so their Mooncake tier lends nothing (mooncake://MASTER?segment=0); what they
save lives in the memory this process lends. Run one per machine that lends memory, after mooncake_master;
everything stored in a holder's segment is lost when it stops.

URL is the engines' own tier URL (or just MASTER_HOST[:PORT]): its master, metadata, protocol, timeout
and admin options apply here too; --segment and --local replace its segment= (the engines' says 0) and
local= (the engines' own address), and the holder's transfer buffer is 1 MiB whatever buffer= says.

example:
  mooncake_master --rpc_port=50051 --rpc_address=10.0.0.5
  kvcodec mooncake-segment 'mooncake://10.0.0.5:50051?segment=0' --segment 8GiB --local 10.0.0.5"""


def _size(text: str) -> int:
    """A segment size above 0 and within this machine's memory (an argparse type)."""
    try:
        n = parse_size(text, "segment")
    except InvalidInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a holder lends more than 0 bytes")
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if n > memory:
        raise argparse.ArgumentTypeError(f"{text!r} is more than this machine's {memory / 2**30:.1f} GiB "
                                         "of memory")
    return n


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = -1.0
    if not s >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The holder's arguments, for :func:`run`."""
    parser.add_argument("url", metavar="URL",
                        help="the Mooncake master: the engines' tier URL, mooncake://MASTER_HOST[:PORT][?OPTIONS] "
                             "(docs/store.md), or MASTER_HOST[:PORT] (port default 50051)")
    parser.add_argument("--segment", type=_size, metavar="SIZE",
                        help="memory to lend, e.g. 8GiB, 512MiB (default: the URL's segment=, which must then be "
                             "above 0)")
    parser.add_argument("--metadata", help="the transfer engine's metadata server: P2PHANDSHAKE (needs nothing but "
                                           "the master) or http://HOST:PORT/metadata (default: the URL's, else "
                                           "P2PHANDSHAKE)")
    parser.add_argument("--local", metavar="HOST",
                        help="the address engines reach this process at: this machine's address when engines run "
                             "elsewhere (default: the URL's local=, else 127.0.0.1)")
    parser.add_argument("--protocol", choices=["tcp", "rdma"], help="transport (default: the URL's, else tcp)")
    parser.add_argument("--wait", type=_seconds, default=DEFAULT_WAIT_S, metavar="SECONDS",
                        help="how long to wait for the master to take the segment before giving up with an error "
                             f"(default: {DEFAULT_WAIT_S:g}); a master that accepts connections but never answers "
                             "holds Mooncake's set-up 90 s unless the URL names its admin=HOST:PORT")


def holder_url(args: argparse.Namespace) -> str:
    """The tier URL the holder opens: ``args.url`` with the options given as flags, the segment to lend and the
    holder's transfer buffer.  :class:`~kvcodec.errors.InvalidInputError` when a flag contradicts the URL or
    nothing is lent."""
    spec = args.url if "://" in args.url else f"mooncake://{args.url}"
    u = urlsplit(spec)
    if u.scheme.lower() != "mooncake":
        raise InvalidInputError(f"{args.url!r} is not a Mooncake URL: write mooncake://MASTER_HOST[:PORT][?OPTIONS] "
                                "or MASTER_HOST[:PORT]")
    query = dict(parse_qsl(u.query, keep_blank_values=True))
    for option, flag in (("metadata", args.metadata), ("protocol", args.protocol)):
        if flag is not None:  # every client of the master uses the same: a difference is a mistake
            if query.get(option, flag) != flag:
                raise InvalidInputError(f"--{option} {flag!r} contradicts the URL's {option}={query[option]!r}; "
                                        "give one")
            query[option] = flag
    if args.local is not None:  # each client's own address: the engines' URL names theirs
        query["local"] = args.local
    if args.segment is not None:
        query["segment"] = str(args.segment)
    elif parse_size(query.get("segment", "0"), f"{args.url!r}: segment") <= 0:
        raise InvalidInputError("a holder lends memory: give --segment SIZE (the URL lends none)")
    query["buffer"] = HOLDER_BUFFER
    return urlunsplit(u._replace(scheme="mooncake", query=urlencode(query)))


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Mount the segment ``args`` describe (:func:`add_arguments`), log one line saying what is lent and where,
    and hold it until SIGTERM or SIGINT (or ``stop`` is set), then unmount; returns 0.  Bad arguments go to
    ``args.parser.error`` when there is one (a command line's), else raise
    :class:`~kvcodec.errors.InvalidInputError`; :class:`~kvcodec.errors.UnsupportedError` without Mooncake;
    ``ConnectionError`` when the master does not take the segment within ``args.wait`` seconds."""
    try:
        import mooncake.store  # noqa: F401  (checked first: the tier would call a missing Mooncake bad input)
    except ImportError as e:
        raise UnsupportedError(f"Mooncake Store's client does not import ({e}): pip install 'kvcodec[mooncake]' "
                               "and, on Debian, apt-get install libibverbs1 ibverbs-providers") from None
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    signalled: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # the handler only appends: taking the Event's lock in a handler could deadlock against the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, _: signalled.append(signum))
    stop = stop or threading.Event()

    def stopping() -> bool:
        return stop.wait(POLL_S) or bool(signalled)

    tier = None
    try:
        with _warnings_kept() as why:
            tier = _open(args)
            mounted = _wait(tier, args.wait, stopping, why)
        if mounted:
            log.info(READY + " %s of memory to the Mooncake master at %s (metadata %s, %s), "
                     "reached at %s; SIGTERM or Ctrl-C unmounts it", _gib(tier.segment_bytes), tier.master,
                     tier.metadata, tier.protocol, tier.local_hostname)
            while not stopping():
                pass
            log.info("mooncake-segment: unmounting %s from %s", _gib(tier.segment_bytes), tier.master)
    finally:
        if tier is not None:
            tier.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _open(args: argparse.Namespace) -> Any:
    """The holder's tier (it sets up once the master answers), or the URL's error as a usage error."""
    try:
        url = holder_url(args)
        try:
            tier = tier_from_url(url)
        except InvalidInputError as e:  # named as the user wrote it, not as the holder rewrote it
            raise InvalidInputError(str(e).replace(repr(url), repr(args.url))) from None
    except InvalidInputError as e:
        if getattr(args, "parser", None) is not None:
            args.parser.error(str(e))
        raise
    tier.name = "mooncake-segment"
    return tier


@contextlib.contextmanager
def _warnings_kept() -> Iterator[list[str]]:
    """The Mooncake tier's warnings, kept in the list instead of logged: while the holder waits for the master the
    tier warns once a second, and the one useful line is the error that ends the wait."""
    why: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        # MooncakeTier._down logs (tier name, reason, seconds): the reason alone is what the error needs
        args = record.args
        why.append(str(args[1]) if isinstance(args, tuple) and len(args) == 3 else record.getMessage())
        return False

    tier_log = logging.getLogger("kvcodec.store.tiers.mooncake")
    tier_log.addFilter(keep)
    try:
        yield why
    finally:
        tier_log.removeFilter(keep)


def _wait(tier: Any, wait_s: float, stopping: Callable[[], bool], why: list[str]) -> bool:
    """Whether ``tier`` mounted its segment before ``stopping()``; ``ConnectionError`` after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while not tier.available:
        if stopping():
            return False
        if time.monotonic() >= deadline:
            port = tier.master.rpartition(":")[2]
            raise ConnectionError(f"no segment mounted: the Mooncake master at {tier.master} did not take it within "
                                  f"{wait_s:g} s: {why[-1] if why else 'no answer'}. Is mooncake_master running "
                                  f"there with --rpc_port={port}?")
    return True


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 1 << 30 else f"{n / 2**20:.0f} MiB"
