"""Streaming container writer: yields the file as byte pieces, never the whole file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from kvcodec.errors import InvalidInputError
from kvcodec.formats.v1 import (CHECKSUM, FOOTER, FOOTER_MAGIC, FRAME_HEAD, FRAME_MAGIC, INDEX_ENTRY, INDEX_HEAD,
                                INDEX_MAGIC, MAX_CHUNKS, MAX_SECTION_BYTES, SECTION_ENTRY, VERSION_MINOR, VERSION_MINOR_JOINT,
                                ChunkEntry, Header, SlotCursor, checksum, pack_preamble)


@dataclass(frozen=True)
class Frame:
    """One encoded chunk: a cell of the header's chunk grid, the variant used and one section per layer."""

    variant: int
    token_start: int
    token_count: int
    layer_start: int
    sections: Sequence[bytes]


def frame_head(frame: Frame) -> tuple[bytes, int]:
    """The bytes before a frame's sections, and their checksum (which the index repeats)."""
    fixed = FRAME_HEAD.pack(FRAME_MAGIC, frame.variant, frame.token_start, frame.token_count,
                            frame.layer_start, len(frame.sections))
    table = b"".join(SECTION_ENTRY.pack(len(s), checksum(s)) for s in frame.sections)
    digest = checksum(fixed, table)
    return fixed + table + CHECKSUM.pack(digest), digest


def write_container(header: Header, frames: Iterable[Frame]) -> Iterator[bytes]:
    """Yield the container for ``header`` and ``frames`` piece by piece.

    Frames must come in the header's cell order (token block, then layer group);
    a cell may carry several variants, in increasing order.
    """
    header.validate()
    header_json = header.to_json()
    preamble = pack_preamble(header_json, VERSION_MINOR_JOINT if any(v.joint for v in header.variants) else VERSION_MINOR)
    first = preamble + header_json + CHECKSUM.pack(checksum(preamble, header_json))
    yield first
    offset = len(first)
    entries: list[ChunkEntry] = []
    cursor = SlotCursor(header)
    for frame in frames:
        try:
            cursor.advance((frame.token_start, frame.token_count, frame.layer_start, len(frame.sections)), frame.variant)
        except ValueError as e:
            raise InvalidInputError(str(e)) from None
        if len(entries) == MAX_CHUNKS:
            raise InvalidInputError(f"more than {MAX_CHUNKS} chunk frames")
        if any(len(s) > MAX_SECTION_BYTES for s in frame.sections):
            raise InvalidInputError("a section exceeds the format's size limit")
        head, digest = frame_head(frame)
        yield head
        yield from frame.sections
        length = len(head) + sum(len(s) for s in frame.sections)
        entries.append(ChunkEntry(frame.variant, frame.token_start, frame.token_count, frame.layer_start,
                                  len(frame.sections), offset, length, digest))
        offset += length
    try:
        cursor.finish()
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
    yield index_bytes(entries, offset)


def index_bytes(entries: list[ChunkEntry], index_offset: int) -> bytes:
    """The chunk index, its checksum and the footer."""
    body = INDEX_HEAD.pack(INDEX_MAGIC, len(entries)) + b"".join(
        INDEX_ENTRY.pack(e.variant, e.token_start, e.token_count, e.layer_start, e.layer_count,
                         e.offset, e.length, e.checksum) for e in entries)
    index = body + CHECKSUM.pack(checksum(body))
    return index + FOOTER.pack(index_offset, len(index), FOOTER_MAGIC)
