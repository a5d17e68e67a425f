"""A tier on local disk: a folder of files, one per key (:class:`DiskTier`)."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
import urllib.parse
from collections import OrderedDict

from kvcodec.errors import InvalidInputError, KVCodecError
from kvcodec.files import atomic_writer
from kvcodec.store.tiers.base import DEFAULT_MAX_VALUE_BYTES, StorageTier, check_size

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
    services: no ownership or mode check, and files get the mode a plain ``open()`` gives under the umask.  The
    folder is opened once, checked through that handle, and every later file operation is relative to it: a folder
    swapped in at its path afterwards (by whoever owns the parent) is never read or written.  Files are opened
    without following symlinks, and a file larger than ``max_value_bytes`` (or the bound a reader asks for) is
    refused unread.
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
        self._dir = _open_folder(self.path, shared)
        self._lock = threading.RLock()
        self._index: OrderedDict[str, int] = OrderedDict()
        now = time.time()
        entries = []
        for filename in self._names():
            st = self._lstat(filename)
            if st is None:
                continue
            if filename.startswith(".tmp-"):
                if now - st.st_mtime > stale_tmp_s:
                    self._unlink_name(filename)
            elif filename.endswith(self.SUFFIX) and stat.S_ISREG(st.st_mode):
                entries.append((st.st_mtime, self._key(filename), st.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size

    def __repr__(self) -> str:
        return f"DiskTier(name={self.name!r}, path={self.path!r}, shared={self.shared})"

    def _file(self, key: str) -> str:
        """``key``'s file name inside the folder."""
        return urllib.parse.quote(key, safe="@-_") + self.SUFFIX

    @staticmethod
    def _key(filename: str) -> str:
        return urllib.parse.unquote(filename[: -len(DiskTier.SUFFIX)])

    def _names(self) -> list[str]:
        try:
            return os.listdir(self._dir)
        except OSError:
            return []

    def _lstat(self, filename: str) -> os.stat_result | None:
        try:
            return os.stat(filename, dir_fd=self._dir, follow_symlinks=False)
        except OSError:
            return None

    def _unlink_name(self, filename: str) -> bool:
        try:
            os.unlink(filename, dir_fd=self._dir)
            return True
        except OSError:
            return False

    def put(self, key: str, value: bytes) -> bool:
        if self.capacity_bytes is not None and len(value) > self.capacity_bytes:
            return False
        try:
            # the rename replaces a symlink planted at the final name; it never writes through it
            with atomic_writer(self._file(key), prefix=".tmp-", fsync=self.fsync, dir_fd=self._dir) as f:
                if not self.shared:
                    os.fchmod(f.fileno(), 0o600)
                f.write(value)
            if self.fsync:
                os.fsync(self._dir)
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
            try:
                data = self._read(k, None)
            except KVCodecError:
                data = None
            self._unlink_name(self._file(k))
            if data is not None and self.on_evict is not None:
                try:
                    self.on_evict(k, data)
                except Exception:
                    log.exception("demoting %s from %s failed", k, self.name)
        return True

    def _read(self, key: str, max_bytes: int | None) -> bytes | None:
        try:
            fd = os.open(self._file(key), os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=self._dir)
        except OSError:  # missing, or a symlink (ELOOP)
            return None
        with os.fdopen(fd, "rb") as f:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return None
                check_size(self, key, st.st_size, self.max_value_bytes, max_bytes)
                data = f.read(st.st_size + 1)
            except OSError:
                return None
        # values are replaced by rename, never rewritten in place: a file that changed size while read was not ours
        return data if len(data) == st.st_size else None

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        try:
            data = self._read(key, max_bytes)
        finally:
            with self._lock:
                self._index.pop(key, None)
        if data is not None:
            with self._lock:
                self._index[key] = len(data)
        return data

    def contains(self, key: str) -> bool:
        st = self._lstat(self._file(key))
        return st is not None and stat.S_ISREG(st.st_mode)

    def value_sizes(self, keys: list[str]) -> list[int | None]:
        sizes = [self._lstat(self._file(key)) for key in keys]
        return [st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None for st in sizes]

    def delete(self, key: str) -> bool:
        with self._lock:
            self._index.pop(key, None)
        return self._unlink_name(self._file(key))

    def keys(self) -> list[str]:
        return [self._key(n) for n in self._names() if n.endswith(self.SUFFIX) and not n.startswith(".tmp-")]

    def size(self) -> int:
        sizes = [self._lstat(self._file(k)) for k in self.keys()]
        return sum(st.st_size for st in sizes if st is not None and stat.S_ISREG(st.st_mode))

    def close(self) -> None:
        with self._lock:
            fd, self._dir = self._dir, -1
        if fd >= 0:
            os.close(fd)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _open_folder(path: str, shared: bool) -> int:
    """The folder at ``path``, open; unless ``shared``, refused (closed) when someone other than this process's user
    can fill it with values of their choosing.  The check is of the open folder, which later operations use."""
    me = os.geteuid()
    fix = ("use a folder of your own (the default is private: ~/.cache/kvcodec/...), or, for a folder deliberately "
           "shared with other trusted users, pass shared=True (in a tier URL: ?shared=true)")
    if not shared:
        link = os.lstat(path)
        if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
            raise InvalidInputError(f"disk tier folder {path} is a symlink owned by user {link.st_uid}, not by this "
                                    f"process's user {me}: {fix}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except NotADirectoryError:
        raise InvalidInputError(f"disk tier folder {path} is not a folder") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidInputError(f"disk tier folder {path} is not a folder")
        if shared:
            return fd
        if st.st_uid != me:
            raise InvalidInputError(f"disk tier folder {path} belongs to user {st.st_uid}, not to this process's "
                                    f"user {me}, who would load whatever KV that user puts there: {fix}")
        if st.st_mode & 0o022:
            raise InvalidInputError(f"disk tier folder {path} is writable by its group or by others (mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}), who could replace the KV it serves: chmod 700 "
                                    f"it, or {fix}")
    except BaseException:
        os.close(fd)
        raise
    return fd
