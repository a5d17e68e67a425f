"""A container taken apart into what a hostile writer controls, and sealed again with every checksum of SPEC.md §4.

:func:`unseal` splits a valid file into its header JSON, its frames (head fields and sections) and its index;
:func:`seal` writes them back, recomputing the header checksum, each section's and frame head's checksum, the
index checksum and the footer, so that a mutation of any part reaches the parser and the decoders instead of
stopping at a checksum.  Sealing an unmutated file gives back its bytes exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvcodec.container import ContainerFile
from kvcodec.container.writer import index_bytes
from kvcodec.formats.v1 import (CHECKSUM, FRAME_HEAD, FRAME_MAGIC, MAGIC, PREAMBLE, SECTION_ENTRY, VERSION_MAJOR,
                                ChunkEntry, checksum)

U32, U64 = (1 << 32) - 1, (1 << 64) - 1


@dataclass
class FrameParts:
    """One frame as written: its head fields, its sections, and optional lies in its section table."""

    variant: int
    token_start: int
    token_count: int
    layer_start: int
    sections: list[bytes]
    layer_count: int | None = None  # the head's count; None: len(sections)
    lengths: dict[int, int] = field(default_factory=dict)  # table lengths that differ from the section's

    def copy(self) -> FrameParts:
        return dataclasses.replace(self, sections=list(self.sections), lengths=dict(self.lengths))


@dataclass
class ContainerParts:
    header: bytes
    frames: list[FrameParts]
    major: int = VERSION_MAJOR
    minor: int = 0
    index: list[ChunkEntry] | None = None  # None: the index the frames imply
    tail: bytes = b""  # after the footer

    def copy(self) -> ContainerParts:
        return dataclasses.replace(self, frames=[f.copy() for f in self.frames],
                                   index=None if self.index is None else list(self.index))


def unseal(data: bytes) -> ContainerParts:
    """The parts of a valid container."""
    with ContainerFile(data) as r:
        (header_len,) = PREAMBLE.unpack_from(data)[3:]
        frames = []
        for i, e in enumerate(r.entries):
            sections = r.read_frame(i).sections
            frames.append(FrameParts(e.variant, e.token_start, e.token_count, e.layer_start,
                                     [sections[l] for l in sorted(sections)]))
        return ContainerParts(data[PREAMBLE.size:PREAMBLE.size + header_len], frames, minor=r.minor_version)


def frame_bytes(f: FrameParts) -> tuple[bytes, int]:
    """A frame's bytes and its head checksum, as the parts say (u32 fields wrap)."""
    count = len(f.sections) if f.layer_count is None else f.layer_count
    fixed = FRAME_HEAD.pack(FRAME_MAGIC, f.variant & U32, f.token_start & U32, f.token_count & U32,
                            f.layer_start & U32, count & U32)
    table = b"".join(SECTION_ENTRY.pack(f.lengths.get(j, len(s)) & U64, checksum(s)) for j, s in enumerate(f.sections))
    digest = checksum(fixed, table)
    return fixed + table + CHECKSUM.pack(digest) + b"".join(f.sections), digest


def _layout(c: ContainerParts) -> tuple[list[bytes], list[ChunkEntry]]:
    preamble = PREAMBLE.pack(MAGIC, c.major & 0xFFFF, c.minor & 0xFFFF, len(c.header))
    out = [preamble, c.header, CHECKSUM.pack(checksum(preamble, c.header))]
    offset = sum(map(len, out))
    entries = []
    for f in c.frames:
        body, digest = frame_bytes(f)
        count = len(f.sections) if f.layer_count is None else f.layer_count
        entries.append(ChunkEntry(f.variant & U32, f.token_start & U32, f.token_count & U32, f.layer_start & U32,
                                  count & U32, offset, len(body), digest))
        out.append(body)
        offset += len(body)
    return out, entries


def implied_index(c: ContainerParts) -> list[ChunkEntry]:
    """The index entries :func:`seal` writes for ``c``'s frames (to mutate and set as ``c.index``)."""
    return _layout(c)[1]


def seal(c: ContainerParts) -> bytes:
    """The container's bytes with every checksum recomputed."""
    out, entries = _layout(c)
    out.append(index_bytes(entries if c.index is None else c.index, sum(map(len, out))))
    return b"".join(out) + c.tail
