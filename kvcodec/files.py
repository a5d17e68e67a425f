"""Files that appear whole: written under a temporary name beside the target, flushed, fsynced and renamed.

The temporary file is created with ``os.open(..., 0o666)`` so the process umask gives it (and so the final file)
the mode a plain ``open(path, "w")`` would, where ``tempfile.mkstemp`` would make every file 0600 and keep a cache
from the other users or services it was meant for.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], *, prefix: str = ".kvcodec-", fsync: bool = True,
                  dir_fd: int | None = None) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; it replaces ``path`` when the block ends without an
    exception, and is removed otherwise.  An ``OSError`` creating it names ``path``, not the temporary file.  With
    ``dir_fd`` (an open folder) ``path`` is a name in that folder, whatever path the folder has meanwhile."""
    path = os.fspath(path)
    directory = "" if dir_fd is not None else os.path.dirname(os.path.abspath(path))
    while True:
        tmp = os.path.join(directory, f"{prefix}{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666,
                         dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise type(e)(e.errno, e.strerror, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def write_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """``path`` holds ``data``, or (after a crash) what it held before."""
    with atomic_writer(path) as f:
        f.write(data)
