"""An opened container (bytes or a seekable file): header and index verified, chunks read on demand.

The bottom of the read path; :class:`kvcodec.Reader` decodes on top of it."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import BinaryIO, Sequence

from kvcodec.container.frames import (FrameHead, check_limit, check_max_bytes, fixed_layer_count, parse_frame_head,
                                      parse_header_block, verify_section)
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.formats.v1 import (CHECKSUM, FOOTER, FOOTER_MAGIC, FRAME_HEAD, INDEX_ENTRY, INDEX_HEAD, INDEX_MAGIC,
                                MAX_CHUNKS, PREAMBLE, SECTION_ENTRY, ChunkEntry, SlotCursor, checksum)

@dataclass(frozen=True)
class FrameData:
    """The verified sections of one chunk, keyed by layer index."""

    entry: ChunkEntry
    sections: dict[int, bytes]


class ContainerFile:
    """Opens a container, verifies header and index, and reads chunks on demand.

    Only the header, the index and the chunks asked for are read; every byte
    read is checked against its checksum before it is used.  ``max_bytes``
    refuses (:class:`LimitExceededError`) a header, index or section longer than it.
    """

    def __init__(self, source: bytes | bytearray | memoryview | str | os.PathLike[str] | BinaryIO,
                 max_bytes: int | None = None) -> None:
        check_max_bytes(max_bytes)
        self.max_bytes = max_bytes
        self._owned = False
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._f: BinaryIO = io.BytesIO(source)
        elif isinstance(source, (str, os.PathLike)):
            self._f = open(source, "rb")
            self._owned = True
        elif hasattr(source, "read") and hasattr(source, "seek"):
            self._f = source
        else:
            raise InvalidInputError(f"cannot read a container from {type(source).__name__}")
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _read_at(self, offset: int, n: int) -> bytes:
        self._f.seek(offset)
        data = self._f.read(n)
        if len(data) != n:
            raise CorruptDataError(f"container is truncated: wanted {n} bytes at offset {offset}")
        return data

    def _open(self) -> None:
        self._f.seek(0, io.SEEK_END)
        self.file_size = size = self._f.tell()
        if size < PREAMBLE.size + CHECKSUM.size + FOOTER.size:
            raise CorruptDataError(f"container is truncated ({size} bytes)")
        pos = PREAMBLE.size

        def read(n: int) -> bytes:
            nonlocal pos
            if pos + n > size:
                raise CorruptDataError("container is truncated inside its header")
            data = self._read_at(pos, n)
            pos += n
            return data

        self.header, self.minor_version = parse_header_block(self._read_at(0, PREAMBLE.size), read, self.max_bytes)
        self.data_start = pos
        index_offset, index_len, magic = FOOTER.unpack(self._read_at(size - FOOTER.size, FOOTER.size))
        if magic != FOOTER_MAGIC:
            raise CorruptDataError("container footer is missing or damaged (truncated file?)")
        if index_offset < self.data_start or index_offset + index_len != size - FOOTER.size or \
                index_len < INDEX_HEAD.size + CHECKSUM.size:
            raise CorruptDataError("container footer points outside the file")
        check_limit(index_len, self.max_bytes, "the chunk index")
        index = self._read_at(index_offset, index_len)
        magic, count = INDEX_HEAD.unpack_from(index)
        if magic != INDEX_MAGIC or count > MAX_CHUNKS or index_len != INDEX_HEAD.size + count * INDEX_ENTRY.size + CHECKSUM.size:
            raise CorruptDataError("chunk index is damaged")
        (stored,) = CHECKSUM.unpack_from(index, index_len - CHECKSUM.size)
        if checksum(index[:-CHECKSUM.size]) != stored:
            raise CorruptDataError("checksum mismatch in the chunk index")
        self.entries: list[ChunkEntry] = [ChunkEntry(*row) for row in
                                          INDEX_ENTRY.iter_unpack(index[INDEX_HEAD.size:-CHECKSUM.size])]
        cursor = SlotCursor(self.header)
        expected_offset = self.data_start
        try:
            for e in self.entries:
                cursor.advance((e.token_start, e.token_count, e.layer_start, e.layer_count), e.variant)
                if e.offset != expected_offset:
                    raise ValueError(f"chunk at offset {e.offset} does not follow the previous one ({expected_offset})")
                expected_offset += e.length
            cursor.finish()
        except ValueError as err:
            raise CorruptDataError(f"chunk index is inconsistent: {err}") from None
        if expected_offset != index_offset:
            raise CorruptDataError("chunk index does not account for every byte before it")

    @property
    def num_chunks(self) -> int:
        return len(self.entries)

    def read_head(self, i: int) -> FrameHead:
        """The verified head of chunk ``i`` (its section table)."""
        e = self.entry(i)
        fixed = self._read_at(e.offset, FRAME_HEAD.size)
        table_size = fixed_layer_count(fixed) * SECTION_ENTRY.size + CHECKSUM.size
        if FRAME_HEAD.size + table_size > e.length:
            raise CorruptDataError(f"chunk {i} is shorter than its own head")
        head = parse_frame_head(fixed, self._read_at(e.offset + FRAME_HEAD.size, table_size))
        if head.checksum != e.checksum or head.cell != (e.token_start, e.token_count, e.layer_start, e.layer_count) \
                or head.variant != e.variant or head.size + head.body_size != e.length:
            raise CorruptDataError(f"chunk {i} does not match its index entry")
        return head

    def entry(self, i: int) -> ChunkEntry:
        if not 0 <= i < len(self.entries):
            raise InvalidInputError(f"chunk {i} does not exist; the container has {len(self.entries)}")
        return self.entries[i]

    def read_frame(self, i: int, layers: Sequence[int] | None = None) -> FrameData:
        """Read and verify the sections of chunk ``i``: all layers, or only ``layers`` (absolute indices)."""
        e = self.entry(i)
        head = self.read_head(i)
        wanted = range(e.layer_start, e.layer_start + e.layer_count) if layers is None else layers
        out = {}
        offset = e.offset + head.size
        starts = {}
        for j, (length, _) in enumerate(head.sections):
            starts[e.layer_start + j] = offset
            offset += length
        for layer in wanted:
            if layer not in starts:
                raise InvalidInputError(f"chunk {i} holds layers {e.layer_start}..{e.layer_start + e.layer_count - 1}, not {layer}")
            length, digest = head.sections[layer - e.layer_start]
            check_limit(length, self.max_bytes, f"chunk {i}, layer {layer}'s section")
            data = self._read_at(starts[layer], length)
            verify_section(data, digest, f"chunk {i}, layer {layer}")
            out[layer] = data
        return FrameData(e, out)

    def close(self) -> None:
        if self._owned:
            self._f.close()

    def __enter__(self) -> ContainerFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
