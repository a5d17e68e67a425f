"""A store's estimates kept from one process to the next: :class:`TelemetryFile`, one small JSON file per store
namespace and model (:func:`default_path`), so that a fresh engine plans its first load on the link and decode
rates its predecessor measured, not on :mod:`kvcodec.store.telemetry`'s priors.

What is kept, and for how long:

- each tier's throughput, by the tier's ``repr`` (which names where it is, a Redis host and database, a folder, a
  Mooncake master, and never a password), for :data:`LINK_MAX_AGE_S`.  It is restored as the link's prior, which
  the first read replaces whole.  The bound matters beyond staleness: a link estimated slow makes the planner
  recompute rather than read, and a store that never reads never measures again, so it must lapse;
- each variant's decode rate (by ``repr(codec)``), each tier's contention pairs and the engine's prefill speed
  (:attr:`Telemetry.prefill`, under ``"engine"``), by :func:`machine` (the CPU, the cores this process may use,
  torch's and kvcodec's versions): they are the machine's, so a file shared over a network home folder keeps each
  machine's apart.  Kept for :data:`MACHINE_MAX_AGE_S`.

The file is written by a background thread at most every :data:`SAVE_EVERY_S` seconds, and when the store closes
(or the interpreter exits with it open), never by a load: a load's observations only update the estimators in memory.  Each write reads the file, keeps the
newer of each entry, drops lapsed ones, bounds each section to :data:`MAX_ENTRIES` and :data:`MAX_MACHINES`, and
replaces it atomically (:func:`~kvcodec.files.write_atomically`), so concurrent writers (tensor-parallel ranks,
several engines) never leave it torn; when two write at once, the later one's view of the other's entries wins
until that one writes again.  A file that is not one of these (damaged, foreign, over :data:`MAX_FILE_BYTES`) is
ignored and left as it is, with one warning.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import platform
import re
import stat
import threading
import time
import weakref
from typing import Any, Mapping

from kvcodec.files import write_atomically
from kvcodec.store.telemetry import Contention, Estimates, Measured, Telemetry
from kvcodec.store.tiers.urls import default_disk_folder

log = logging.getLogger(__name__)

FORMAT = "kvcodec-telemetry/1"
#: Names the folder of the files instead of ``$XDG_CACHE_HOME/kvcodec/telemetry``.
DIR_ENV = "KVCODEC_TELEMETRY_DIR"
SAVE_EVERY_S = 5.0
#: A link's path and load change over minutes to hours (a shaper reset, a move, other tenants): a restart within an
#: hour (a crash, a redeploy) most likely sees the same link.
LINK_MAX_AGE_S = 3600.0
#: Decode rates and contention are the machine's, keyed by it; a week bounds what the key cannot see (other
#: tenants' load, power settings).
MACHINE_MAX_AGE_S = 7 * 86400.0
MAX_ENTRIES = 32
MAX_MACHINES = 4
MAX_KEY_CHARS = 512
MAX_FILE_BYTES = 256 << 10  # the bounds above make at most about 130 KB
CLOCK_SKEW_S = 60.0  # an entry dated further ahead than this is not believed
ENGINE = "engine"  # the key of the engine's prefill speed in a machine's "prefill" section (one engine per file)


def default_path(model: str, namespace: str = "") -> str:
    """The file of the store of ``model`` in ``namespace``: in ``$KVCODEC_TELEMETRY_DIR``, else the per-user cache
    folder's ``kvcodec/telemetry`` (the disk tiers' rule), named by both."""
    folder = os.environ.get(DIR_ENV) or default_disk_folder("telemetry")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{namespace}-{model}" if namespace else model)[:64]
    digest = hashlib.sha256(f"{namespace}\0{model}".encode()).hexdigest()[:16]
    return os.path.join(folder, f"{readable}-{digest}.json")


def machine() -> str:
    """What a decode rate depends on besides the codec and the model: the CPU's architecture and model, how many
    cores this process may use, torch's and kvcodec's versions.  (A device's name is left out: asking for it
    initialises CUDA, which an engine's parent process must not before it forks its workers.)"""
    import torch

    from kvcodec import __version__

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.machine()} {cpu} x{cores}; torch {torch.__version__}; kvcodec {__version__}"


class TelemetryFile:
    """``telemetry`` kept in the file ``path``: restored from it now, for tiers named as in ``locations`` (tier name
    to the tier's ``repr``), and :attr:`restored` says what, in a line for the engine's log (None: nothing); saved
    by :meth:`start`'s thread and by :meth:`close`."""

    def __init__(self, path: str | os.PathLike[str], telemetry: Telemetry, locations: Mapping[str, str]) -> None:
        self.path = os.fspath(path)
        self.telemetry = telemetry
        self.locations = dict(locations)
        self.machine = machine()
        self._saved: Estimates | None = None
        self._warned = False
        self._save_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restored: str | None = None  # what restore() found, in a line for the engine's log
        self.restore()
        self._saved = telemetry.estimates()  # what was restored is in the file already

    # -- reading -------------------------------------------------------------------------------------------
    def restore(self) -> None:
        """Start ``telemetry`` from the file's entries that are fresh enough."""
        data = self._read()
        if data is None:
            return
        now = time.time()
        by_location = {loc: name for name, loc in self.locations.items()}
        mine = data["machines"].get(self.machine, _empty_machine())
        prefill = mine["prefill"].get(ENGINE)
        found = Estimates(
            links={by_location[loc]: m for loc, m in data["links"].items()
                   if loc in by_location and _fresh(m, now, LINK_MAX_AGE_S)},
            contention={by_location[loc]: m for loc, m in mine["contention"].items()
                        if loc in by_location and _fresh(m, now, MACHINE_MAX_AGE_S)},
            decode={k: m for k, m in mine["decode"].items() if _fresh(m, now, MACHINE_MAX_AGE_S)},
            prefill=prefill if prefill is not None and _fresh(prefill, now, MACHINE_MAX_AGE_S) else None)
        self.telemetry.restore(found)
        if found.links or found.decode or found.prefill:
            links = ", ".join(f"link {name} {m.value * 8 / 1e6:.1f} Mbit/s ({now - m.at:.0f} s old)"
                              for name, m in found.links.items())
            prefill = "" if found.prefill is None else f"; prefill {found.prefill.value:.0f} tokens/s"
            self.restored = (f"kvcodec: the store starts from the estimates in {self.path}: {links or 'no link'}; "
                             f"decode rates of {len(found.decode)} variant(s){prefill}")

    def _read(self) -> dict[str, Any] | None:
        """The file's entries, checked (none where there is no file yet; None for one not to read or overwrite,
        warned about)."""
        try:
            # non-blocking: a FIFO put at the path must not hang the store
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return {"links": {}, "machines": {}}
        except OSError as e:
            self._warn(f"cannot be read ({e})")
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._warn("is not a regular file")
                return None
            try:
                raw = f.read(MAX_FILE_BYTES + 1)
            except OSError as e:
                self._warn(f"cannot be read ({e})")
                return None
        if len(raw) > MAX_FILE_BYTES:
            self._warn(f"is over {MAX_FILE_BYTES} bytes")
            return None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            self._warn("is not JSON")
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            self._warn(f"is not a {FORMAT} file")
            return None
        links, machines = data.get("links"), data.get("machines")
        out: dict[str, Any] = {"links": _entries(links, _rate), "machines": {}}
        for name, m in (machines.items() if isinstance(machines, dict) else ()):
            if isinstance(name, str) and len(name) <= MAX_KEY_CHARS and isinstance(m, dict):
                out["machines"][name] = {"decode": _entries(m.get("decode"), _rate),
                                         "contention": _entries(m.get("contention"), _pairs),
                                         "prefill": _entries(m.get("prefill"), _rate)}
        return out

    def _warn(self, why: str) -> None:
        self._warn_once("kvcodec: the store's estimates file %s %s: not read and left as it is, so this process "
                        "plans its first loads on priors; remove it, or name another with the store setting "
                        "'telemetry'", self.path, why)

    def _warn_once(self, message: str, *args: Any) -> None:
        """One warning per store about its file: a fault there repeats at every save."""
        if not self._warned:
            self._warned = True
            log.warning(message, *args)

    # -- writing -------------------------------------------------------------------------------------------
    def save(self) -> bool:
        """Merge what ``telemetry`` measured since the last save into the file; whether it was written."""
        with self._save_lock:
            estimates = self.telemetry.estimates()
            if estimates == self._saved or not (estimates.links or estimates.decode or estimates.contention
                                                or estimates.prefill):
                return False
            data = self._read()
            if data is None:
                return False
            links = data["links"]
            mine = data["machines"].setdefault(self.machine, _empty_machine())
            for section, found in ((links, estimates.links), (mine["contention"], estimates.contention)):
                for name, m in found.items():
                    loc = self.locations.get(name)
                    if loc is not None and len(loc) <= MAX_KEY_CHARS and m.at >= section.get(loc, m).at:
                        section[loc] = m
            prefill = {} if estimates.prefill is None else {ENGINE: estimates.prefill}
            for section, found in ((mine["decode"], estimates.decode), (mine["prefill"], prefill)):
                for key, m in found.items():
                    if len(key) <= MAX_KEY_CHARS and m.at >= section.get(key, m).at:
                        section[key] = m
            text = json.dumps(_document(data, time.time()), separators=(",", ":")).encode()
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), mode=0o700, exist_ok=True)
                write_atomically(self.path, text)
            except OSError as e:
                self._warn_once("kvcodec: the store's estimates could not be written to %s (%s); this process "
                                "goes on measuring, the next starts on priors", self.path, e)
                return False
            self._saved = estimates
            return True

    def start(self) -> TelemetryFile:
        """Save from a background thread every :data:`SAVE_EVERY_S` seconds (when there is something new), and at
        exit.  Both hold this object weakly: a store dropped without closing takes its thread with it."""
        ref = weakref.ref(self)
        self._thread = threading.Thread(target=_save_every, args=(ref, self._stop), name="kvcodec-telemetry-file",
                                        daemon=True)
        self._thread.start()
        atexit.register(_close, ref)
        return self

    def close(self) -> None:
        """Stop the thread and save what is new."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.save()


def _save_every(ref: weakref.ref[TelemetryFile], stop: threading.Event) -> None:
    while not stop.wait(SAVE_EVERY_S):
        file = ref()
        if file is None:
            return
        try:
            file.save()
        except Exception:  # noqa: BLE001 - a thread that keeps estimates must never take the engine down
            log.warning("kvcodec: saving the store's estimates to %s failed", file.path, exc_info=True)
        del file


def _close(ref: weakref.ref[TelemetryFile]) -> None:
    file = ref()
    if file is not None:
        file.close()


def _empty_machine() -> dict[str, dict[str, Measured]]:
    return {"decode": {}, "contention": {}, "prefill": {}}


def _fresh(m: Measured, now: float, max_age_s: float) -> bool:
    return -CLOCK_SKEW_S <= now - m.at <= max_age_s


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _rate(entry: dict[str, Any]) -> Measured | None:
    rate = entry.get("rate")
    return Measured(float(rate), float(entry["at"])) if _number(rate) and rate > 0 else None


def _pairs(entry: dict[str, Any]) -> Measured | None:
    pairs = entry.get("pairs")
    if not (isinstance(pairs, list) and 0 < len(pairs) <= Contention.WINDOW and all(
            isinstance(p, list) and len(p) == 2 and all(_number(x) and x > 0 for x in p) for p in pairs)):
        return None
    return Measured(tuple((float(a), float(r)) for a, r in pairs), float(entry["at"]))


def _entries(section: Any, parse: Any) -> dict[str, Measured]:
    """The well-formed entries of ``section`` (a mapping of key to entry with ``at``); others are skipped."""
    out: dict[str, Measured] = {}
    for key, entry in (section.items() if isinstance(section, dict) else ()):
        if isinstance(key, str) and len(key) <= MAX_KEY_CHARS and isinstance(entry, dict) and _number(entry.get("at")):
            m = parse(entry)
            if m is not None:
                out[key] = m
    return out


def _document(data: dict[str, Any], now: float) -> dict[str, Any]:
    """``data`` as the file holds it: lapsed entries dropped, each section its newest :data:`MAX_ENTRIES`, the
    :data:`MAX_MACHINES` machines measured most lately."""

    def section(entries: dict[str, Measured], max_age_s: float, field: str) -> dict[str, Any]:
        kept = sorted(((k, m) for k, m in entries.items() if _fresh(m, now, max_age_s)), key=lambda e: -e[1].at)
        return {k: {field: [list(p) for p in m.value] if field == "pairs" else m.value, "at": m.at}
                for k, m in kept[:MAX_ENTRIES]}

    machines = {name: {"decode": section(m["decode"], MACHINE_MAX_AGE_S, "rate"),
                       "contention": section(m["contention"], MACHINE_MAX_AGE_S, "pairs"),
                       "prefill": section(m["prefill"], MACHINE_MAX_AGE_S, "rate")}
                for name, m in data["machines"].items()}
    latest = {name: max((e["at"] for s in m.values() for e in s.values()), default=None)
              for name, m in machines.items()}
    kept = sorted((n for n in machines if latest[n] is not None), key=lambda n: -latest[n])[:MAX_MACHINES]
    return {"format": FORMAT, "links": section(data["links"], LINK_MAX_AGE_S, "rate"),
            "machines": {n: machines[n] for n in kept}}
