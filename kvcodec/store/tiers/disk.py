"""A tier on local disk: a folder of files, one per key (:class:`DiskTier`)."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
import urllib.parse
from collections import OrderedDict

from kvcodec.errors import InvalidInputError
from kvcodec.files import atomic_writer
from kvcodec.store.tiers.base import DEFAULT_MAX_VALUE_BYTES, StorageTier

log = logging.getLogger(__name__)


class DiskTier(StorageTier):
    """A folder of files, one per key, written atomically.

    A value is written to a temporary file in the same folder (``.tmp-*``), flushed and
    fsynced, then renamed over the final name, and the folder is fsynced: a reader sees
    the old value, the new value, or nothing, never a partial file, even after a kill in
    mid-write.  Temporary files are never served; those older than ``stale_tmp_s`` are
    removed when the tier opens.  ``capacity_bytes`` (None: unbounded) evicts the least
    recently used files, as this process saw them.

    Whoever can write the folder chooses the KV an engine loads, and the files hold prompts' token ids.  So by
    default the folder is private: created 0700, refused when another user owns it or its group or others may write
    it, and files are created 0600.  ``shared=True`` is for a folder deliberately shared with other trusted users or
    services: no ownership or mode check, and files get the mode a plain ``open()`` gives under the umask.  Files
    are opened without following symlinks, and a file larger than ``max_value_bytes`` is a miss (with a warning)
    rather than an allocation of its size.
    """

    name = "disk"
    SUFFIX = ".kvc"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int | None = None, *, name: str | None = None,
                 fsync: bool = True, stale_tmp_s: float = 3600.0, shared: bool = False,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.shared = shared
        self.max_value_bytes = max_value_bytes
        if name:
            self.name = name
        os.makedirs(self.path, mode=0o777 if shared else 0o700, exist_ok=True)
        if not shared:
            _check_private_folder(self.path)
        self._lock = threading.RLock()
        self._index: OrderedDict[str, int] = OrderedDict()
        now = time.time()
        entries = []
        for entry in os.scandir(self.path):
            if entry.name.startswith(".tmp-"):
                try:
                    if now - entry.stat(follow_symlinks=False).st_mtime > stale_tmp_s:
                        os.unlink(entry.path)
                except OSError:
                    pass
            elif entry.name.endswith(self.SUFFIX) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                entries.append((st.st_mtime, self._key(entry.name), st.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size

    def __repr__(self) -> str:
        return f"DiskTier(name={self.name!r}, path={self.path!r}, shared={self.shared})"

    def _file(self, key: str) -> str:
        return os.path.join(self.path, urllib.parse.quote(key, safe="@-_") + self.SUFFIX)

    @staticmethod
    def _key(filename: str) -> str:
        return urllib.parse.unquote(filename[: -len(DiskTier.SUFFIX)])

    def put(self, key: str, value: bytes) -> bool:
        if self.capacity_bytes is not None and len(value) > self.capacity_bytes:
            return False
        target = self._file(key)
        try:
            # the rename replaces a symlink planted at the final name; it never writes through it
            with atomic_writer(target, prefix=".tmp-", fsync=self.fsync) as f:
                if not self.shared:
                    os.fchmod(f.fileno(), 0o600)
                f.write(value)
            if self.fsync:
                dfd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError:
            log.warning("disk tier %s: could not write %s", self.path, key, exc_info=True)
            return False
        evicted = []
        with self._lock:
            self._index.pop(key, None)
            self._index[key] = len(value)
            total = sum(self._index.values())
            while self.capacity_bytes is not None and total > self.capacity_bytes and len(self._index) > 1:
                k, n = self._index.popitem(last=False)
                total -= n
                evicted.append(k)
        for k in evicted:
            data = self._read(k)
            self._unlink(k)
            if data is not None and self.on_evict is not None:
                try:
                    self.on_evict(k, data)
                except Exception:
                    log.exception("demoting %s from %s failed", k, self.name)
        return True

    def _read(self, key: str) -> bytes | None:
        try:
            fd = os.open(self._file(key), os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # missing, or a symlink (ELOOP)
            return None
        with os.fdopen(fd, "rb") as f:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return None
                if st.st_size > self.max_value_bytes:
                    log.warning("disk tier %s: %s holds %d bytes, more than max_value_bytes=%d; treated as a miss",
                                self.path, key, st.st_size, self.max_value_bytes)
                    return None
                data = f.read(st.st_size + 1)
            except OSError:
                return None
        # values are replaced by rename, never rewritten in place: a file that changed size while read was not ours
        return data if len(data) == st.st_size else None

    def _unlink(self, key: str) -> bool:
        try:
            os.unlink(self._file(key))
            return True
        except OSError:
            return False

    def get(self, key: str) -> bytes | None:
        data = self._read(key)
        with self._lock:
            if data is None:
                self._index.pop(key, None)
            else:
                self._index.pop(key, None)
                self._index[key] = len(data)
        return data

    def contains(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._file(key)).st_mode)
        except OSError:
            return False

    def value_sizes(self, keys: list[str]) -> list[int | None]:
        out: list[int | None] = []
        for key in keys:
            try:
                st = os.lstat(self._file(key))
                out.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
            except OSError:
                out.append(None)
        return out

    def delete(self, key: str) -> bool:
        with self._lock:
            self._index.pop(key, None)
        return self._unlink(key)

    def keys(self) -> list[str]:
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        return [self._key(n) for n in names if n.endswith(self.SUFFIX) and not n.startswith(".tmp-")]

    def size(self) -> int:
        total = 0
        for k in self.keys():
            try:
                st = os.lstat(self._file(k))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
        return total


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _check_private_folder(path: str) -> None:
    """Refuse a folder that someone other than this process's user can fill with values of their choosing."""
    me = os.geteuid()
    fix = ("use a folder of your own (the default is private: ~/.cache/kvcodec/...), or, for a folder deliberately "
           "shared with other trusted users, pass shared=True (in a tier URL: ?shared=true)")
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
        raise InvalidInputError(f"disk tier folder {path} is a symlink owned by user {link.st_uid}, not by this "
                                f"process's user {me}: {fix}")
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidInputError(f"disk tier folder {path} is not a folder")
    if st.st_uid != me:
        raise InvalidInputError(f"disk tier folder {path} belongs to user {st.st_uid}, not to this process's user "
                                f"{me}, who would load whatever KV that user puts there: {fix}")
    if st.st_mode & 0o022:
        raise InvalidInputError(f"disk tier folder {path} is writable by its group or by others (mode "
                                f"{stat.S_IMODE(st.st_mode):04o}), who could replace the KV it serves: chmod 700 it, "
                                f"or {fix}")
