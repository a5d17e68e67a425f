"""Sequential container parser over byte pieces as they arrive (a socket, a queue, a file read in pieces)."""

from __future__ import annotations

from typing import Iterable, Iterator

from kvcodec.container.frames import (FrameHead, check_limit, check_max_bytes, fixed_layer_count, parse_frame_head,
                                      parse_header_block, verify_section)
from kvcodec.container.writer import index_bytes
from kvcodec.errors import CorruptDataError
from kvcodec.formats.v1 import (CHECKSUM, FRAME_HEAD, FRAME_MAGIC, INDEX_MAGIC, PREAMBLE, SECTION_ENTRY, ChunkEntry,
                                Header, SlotCursor)


class _Pieces:
    """Reads exact byte counts out of an iterator of arbitrary pieces."""

    def __init__(self, pieces: Iterable[bytes]) -> None:
        self._it = iter(pieces)
        self._buf = bytearray()
        self._pos = 0
        self.consumed = 0

    def _fill(self, n: int) -> bool:
        while len(self._buf) - self._pos < n:
            piece = next(self._it, None)
            if piece is None:
                return False
            if self._pos:
                del self._buf[: self._pos]
                self._pos = 0
            self._buf += piece
        return True

    def read(self, n: int) -> bytes:
        if not self._fill(n):
            raise CorruptDataError(f"stream ended early: wanted {n} more bytes after {self.consumed}")
        out = bytes(self._buf[self._pos:self._pos + n])
        self._pos += n
        self.consumed += n
        return out

    def at_end(self) -> bool:
        return not self._fill(1)


def iter_frames(pieces: Iterable[bytes], max_bytes: int | None = None) -> tuple[Header, Iterator[tuple[FrameHead, list[bytes]]]]:
    """Parse a container from ``pieces`` in order.

    Returns the verified header at once and an iterator of ``(frame head,
    sections)`` that yields each chunk as soon as its bytes have arrived and
    its checksums pass.  The iterator ends after checking the index and footer
    against the frames it saw; anything left over is corrupt data.  A header or
    section longer than ``max_bytes`` is refused before it is buffered.
    """
    check_max_bytes(max_bytes)
    src = _Pieces(pieces)
    header, _ = parse_header_block(src.read(PREAMBLE.size), src.read, max_bytes)
    return header, _frames(src, header, max_bytes)


def _frames(src: _Pieces, header: Header, max_bytes: int | None) -> Iterator[tuple[FrameHead, list[bytes]]]:
    cursor = SlotCursor(header)
    entries: list[ChunkEntry] = []
    while True:
        offset = src.consumed
        magic = src.read(4)
        if magic == INDEX_MAGIC:
            break
        if magic != FRAME_MAGIC:
            raise CorruptDataError(f"expected a chunk or the index at offset {offset}")
        fixed = magic + src.read(FRAME_HEAD.size - 4)
        head = parse_frame_head(fixed, src.read(fixed_layer_count(fixed) * SECTION_ENTRY.size + CHECKSUM.size))
        try:
            cursor.advance(head.cell, head.variant)
        except ValueError as e:
            raise CorruptDataError(str(e)) from None
        sections = []
        for j, (length, digest) in enumerate(head.sections):
            check_limit(length, max_bytes, f"the section of layer {head.layer_start + j} of the chunk at offset {offset}")
            data = src.read(length)
            verify_section(data, digest, f"chunk at offset {offset}, layer {head.layer_start + j}")
            sections.append(data)
        entries.append(ChunkEntry(head.variant, *head.cell, offset, head.size + head.body_size, head.checksum))
        yield head, sections
    try:
        cursor.finish()
    except ValueError as e:
        raise CorruptDataError(str(e)) from None
    expected = index_bytes(entries, offset)
    if INDEX_MAGIC + src.read(len(expected) - 4) != expected:
        raise CorruptDataError("the chunk index or footer does not match the chunks in the stream")
    if not src.at_end():
        raise CorruptDataError("unexpected bytes after the container footer")
