"""Parsing of the pieces shared by the random-access reader and the stream parser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvcodec.errors import CorruptDataError, InvalidInputError, LimitExceededError
from kvcodec.formats.v1 import (CHECKSUM, FRAME_HEAD, FRAME_MAGIC, MAX_LAYERS, MAX_SECTION_BYTES, SECTION_ENTRY, Header, checksum,
                                parse_preamble)


@dataclass(frozen=True)
class FrameHead:
    """A verified frame head: what the chunk covers and its section table."""

    variant: int
    token_start: int
    token_count: int
    layer_start: int
    sections: tuple[tuple[int, int], ...]  # (length, xxh3-64) per layer
    checksum: int

    @property
    def cell(self) -> tuple[int, int, int, int]:
        return self.token_start, self.token_count, self.layer_start, len(self.sections)

    @property
    def size(self) -> int:
        return FRAME_HEAD.size + len(self.sections) * SECTION_ENTRY.size + CHECKSUM.size

    @property
    def body_size(self) -> int:
        return sum(length for length, _ in self.sections)


def fixed_layer_count(fixed: bytes) -> int:
    """From the fixed part of a frame head, the number of table entries that follow (bounded)."""
    magic, _, _, _, _, layer_count = FRAME_HEAD.unpack(fixed)
    if magic != FRAME_MAGIC:
        raise CorruptDataError("chunk frame has a bad magic")
    if not 1 <= layer_count <= MAX_LAYERS:
        raise CorruptDataError(f"chunk frame claims {layer_count} layers")
    return layer_count


def parse_frame_head(fixed: bytes, rest: bytes) -> FrameHead:
    """Verify and parse a frame head from its fixed part and the table plus checksum after it."""
    _, variant, t0, tn, l0, lc = FRAME_HEAD.unpack(fixed)
    table = rest[:-CHECKSUM.size]
    (stored,) = CHECKSUM.unpack(rest[-CHECKSUM.size:])
    digest = checksum(fixed, table)
    if digest != stored:
        raise CorruptDataError(f"checksum mismatch in the head of chunk (tokens {t0}+{tn}, layers {l0}+{lc})")
    sections = tuple(SECTION_ENTRY.iter_unpack(table))
    if any(length > MAX_SECTION_BYTES for length, _ in sections):
        raise CorruptDataError(f"chunk at token {t0} claims a section over the {MAX_SECTION_BYTES}-byte limit")
    return FrameHead(variant, t0, tn, l0, sections, digest)


def check_limit(size: int, max_bytes: int | None, what: str) -> None:
    """Refuse, before allocating it, anything larger than the caller's ``max_bytes``."""
    if max_bytes is not None and size > max_bytes:
        raise LimitExceededError(f"{what} is {size} bytes, over the caller's max_bytes={max_bytes}")


def check_max_bytes(max_bytes: int | None) -> None:
    if max_bytes is not None and not (isinstance(max_bytes, int) and not isinstance(max_bytes, bool) and max_bytes > 0):
        raise InvalidInputError(f"max_bytes must be a positive integer or None, not {max_bytes!r}")


def verify_section(data: bytes | memoryview, expected: int, where: str) -> None:
    if checksum(data) != expected:
        raise CorruptDataError(f"checksum mismatch in {where}")


def parse_header_block(preamble: bytes, read: Callable[[int], bytes], max_bytes: int | None = None) -> tuple[Header, int]:
    """Parse the header after ``preamble``; ``read(n)`` must return exactly n more bytes.
    Returns the header and the file's minor version."""
    header_len, minor = parse_preamble(preamble)
    check_limit(header_len, max_bytes, "the container header")
    header_json = read(header_len)
    (stored,) = CHECKSUM.unpack(read(CHECKSUM.size))
    if checksum(preamble, header_json) != stored:
        raise CorruptDataError("checksum mismatch in the container header")
    return Header.from_json(header_json), minor
