"""Container format v1: the byte layout, its limits and the strict header schema.

SPEC.md is the prose version of this module; the two must agree.  Every integer
is little-endian.  Everything a reader must trust before allocating is either a
fixed-size struct or bounded by a limit below, and is covered by an xxh3-64
checksum that is verified before any length inside it is used.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator

import xxhash

from kvcodec.formats.errors import CorruptDataError, InvalidInputError, UnsupportedVersionError

MAGIC = b"\x89KVC\r\n\x1a\n"
VERSION_MAJOR = 1
VERSION_MINOR = 0  # written when no variant has joint sections
VERSION_MINOR_JOINT = 1  # 1.1: variants may have joint sections (SPEC.md §6.7)

# magic(8) | major u16 | minor u16 | header_len u32
PREAMBLE = struct.Struct("<8sHHI")
CHECKSUM = struct.Struct("<Q")
FRAME_MAGIC = b"KVCK"
# magic(4) | variant u32 | token_start u32 | token_count u32 | layer_start u32 | layer_count u32
FRAME_HEAD = struct.Struct("<4sIIIII")
# one per layer of the chunk: section length u64 | section xxh3-64
SECTION_ENTRY = struct.Struct("<QQ")
INDEX_MAGIC = b"KVIX"
INDEX_HEAD = struct.Struct("<4sI")
# variant u32 | token_start u32 | token_count u32 | layer_start u32 | layer_count u32 | offset u64 | length u64 | frame checksum u64
INDEX_ENTRY = struct.Struct("<IIIIIQQQ")
FOOTER_MAGIC = b"KVCEND01"
# index offset u64 | index length u64 | magic(8)
FOOTER = struct.Struct("<QQ8s")

MAX_HEADER_BYTES = 16 << 20
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_TOKENS = 1 << 26
MAX_CHUNK_TOKENS = 1 << 20
MAX_VARIANTS = 64
MAX_CHUNKS = 1 << 24
MAX_SECTION_BYTES = 1 << 36
MAX_JSON_DEPTH = 64
DTYPES = ("float32", "float16", "bfloat16")
ROPE_STATES = ("pre", "post")


def checksum(*parts: bytes | memoryview) -> int:
    """xxh3-64 of the concatenation of ``parts``."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


@dataclass(frozen=True)
class LayerShape:
    """Shape of one layer: keys are ``[heads, tokens, key_dim]``, values ``[heads, tokens, value_dim]``."""

    heads: int
    tokens: int
    key_dim: int
    value_dim: int

    @property
    def elements(self) -> int:
        return self.heads * self.tokens * (self.key_dim + self.value_dim)


@dataclass(frozen=True)
class Variant:
    """One encoding of the chunks: a codec id and its config."""

    codec: str
    config: dict[str, Any]
    joint: bool = False  # one section per frame, holding all its layers (format 1.1)

    def to_dict(self) -> dict[str, Any]:
        return {"codec": self.codec, "config": self.config} | ({"joint": True} if self.joint else {})


@dataclass(frozen=True)
class Header:
    """Everything the JSON header of a container says."""

    dtype: str
    layers: tuple[LayerShape, ...]
    variants: tuple[Variant, ...]
    chunk_tokens: int
    chunk_layers: int
    meta: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property  # cell() asks for it once per chunk
    def max_tokens(self) -> int:
        return max((s.tokens for s in self.layers), default=0)

    @property
    def token_blocks(self) -> int:
        return math.ceil(self.max_tokens / self.chunk_tokens)

    @property
    def layer_groups(self) -> int:
        return math.ceil(len(self.layers) / self.chunk_layers)

    @property
    def num_cells(self) -> int:
        return self.token_blocks * self.layer_groups

    def cell(self, i: int) -> tuple[int, int, int, int]:
        """(token_start, token_count, layer_start, layer_count) of the ``i``-th chunk in file order."""
        b, g = divmod(i, self.layer_groups)
        t0, l0 = b * self.chunk_tokens, g * self.chunk_layers
        return t0, min(self.chunk_tokens, self.max_tokens - t0), l0, min(self.chunk_layers, len(self.layers) - l0)

    def cells(self) -> Iterator[tuple[int, int, int, int]]:
        """Every chunk's cell of the grid, in file order (computed as it goes: a header may declare millions)."""
        return (self.cell(i) for i in range(self.num_cells))

    def local_range(self, layer: int, token_start: int, token_count: int) -> tuple[int, int]:
        """The slice of ``layer``'s own token axis that a chunk's token range covers.

        A layer holding fewer tokens than the longest (a sliding window) holds the
        *last* tokens of the sequence, so its axis is right-aligned.
        """
        shift = self.max_tokens - self.layers[layer].tokens
        lo = max(token_start - shift, 0)
        hi = max(token_start + token_count - shift, 0)
        return lo, hi

    def to_json(self) -> bytes:
        obj = {
            "dtype": self.dtype,
            "layers": [[s.heads, s.tokens, s.key_dim, s.value_dim] for s in self.layers],
            "variants": [v.to_dict() for v in self.variants],
            "chunk_tokens": self.chunk_tokens,
            "chunk_layers": self.chunk_layers,
            "meta": self.meta,
        }
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Header:
        """Parse and validate a header; any deviation from the schema is corrupt data."""
        try:
            obj = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError) as e:
            raise CorruptDataError(f"container header is not valid JSON: {e}") from None
        except RecursionError:  # the parser's own stack bound, far deeper than MAX_JSON_DEPTH
            obj = None
        _require(obj is not None and _depth(obj) <= MAX_JSON_DEPTH, f"header JSON nests deeper than {MAX_JSON_DEPTH} levels")
        _require(isinstance(obj, dict), "header is not a JSON object")
        expected = {"dtype", "layers", "variants", "chunk_tokens", "chunk_layers", "meta"}
        _require(expected <= set(obj), f"header lacks {sorted(expected - set(obj))}")
        _require(obj["dtype"] in DTYPES, f"header dtype {obj['dtype']!r} is not one of {DTYPES}")
        layers = obj["layers"]
        _require(isinstance(layers, list) and 1 <= len(layers) <= MAX_LAYERS, "header layers must be a list of 1 to 4096")
        shapes = []
        for i, s in enumerate(layers):
            _require(isinstance(s, list) and len(s) == 4 and all(_is_int(x) for x in s), f"layer {i} shape must be 4 integers")
            h, t, dk, dv = s
            _require(1 <= h <= MAX_HEADS and 0 <= t <= MAX_TOKENS and 1 <= dk <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM,
                     f"layer {i} shape {s} is out of bounds")
            shapes.append(LayerShape(h, t, dk, dv))
        variants = obj["variants"]
        _require(isinstance(variants, list) and 1 <= len(variants) <= MAX_VARIANTS, "header needs 1 to 64 variants")
        vs = []
        for v in variants:
            _require(isinstance(v, dict) and isinstance(v.get("codec"), str) and isinstance(v.get("config"), dict),
                     "variant must be {codec: str, config: object}")
            _require(isinstance(v.get("joint", False), bool), "variant key joint must be true or false")
            vs.append(Variant(v["codec"], v["config"], v.get("joint", False)))
        ct, cl = obj["chunk_tokens"], obj["chunk_layers"]
        _require(_is_int(ct) and 1 <= ct <= MAX_CHUNK_TOKENS, f"chunk_tokens {ct!r} out of bounds")
        _require(_is_int(cl) and 1 <= cl <= MAX_LAYERS, f"chunk_layers {cl!r} out of bounds")
        _require(isinstance(obj["meta"], dict), "meta must be an object")
        header = cls(obj["dtype"], tuple(shapes), tuple(vs), ct, cl, obj["meta"])
        _require(header.num_cells <= MAX_CHUNKS, f"{header.num_cells} chunks exceed the {MAX_CHUNKS} limit")
        header._check_meta()
        return header

    def _check_meta(self) -> None:
        meta = self.meta
        _require(isinstance(meta.get("model", ""), str), "meta.model must be a string")
        _require(meta.get("rope", "pre") in ROPE_STATES, f"meta.rope must be one of {ROPE_STATES}")
        for key in ("token_ids", "positions"):
            if key in meta:
                seq = meta[key]
                _require(isinstance(seq, list) and all(_is_int(x) for x in seq), f"meta.{key} must be a list of integers")
                _require(len(seq) == self.max_tokens, f"meta.{key} has {len(seq)} entries for {self.max_tokens} tokens")

    def validate(self) -> None:
        """Raise :class:`InvalidInputError` if this header cannot be written."""
        try:
            Header.from_json(self.to_json())
        except CorruptDataError as e:
            raise InvalidInputError(str(e)) from None
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"header is not JSON-serialisable: {e}") from None


@dataclass(frozen=True)
class ChunkEntry:
    """One row of the chunk index: where a chunk frame is and what it covers."""

    variant: int
    token_start: int
    token_count: int
    layer_start: int
    layer_count: int
    offset: int
    length: int
    checksum: int


def pack_preamble(header_json: bytes, minor: int = VERSION_MINOR) -> bytes:
    return PREAMBLE.pack(MAGIC, VERSION_MAJOR, minor, len(header_json))


def parse_preamble(buf: bytes) -> tuple[int, int]:
    """Check magic and major version; return the header length and the minor version."""
    magic, major, minor, header_len = PREAMBLE.unpack(buf)
    if magic != MAGIC:
        raise CorruptDataError("not a kvcodec container (bad magic)")
    if major != VERSION_MAJOR:
        raise UnsupportedVersionError(
            f"container format version {major}.{minor} is not supported (this build reads {VERSION_MAJOR}.x)")
    if header_len > MAX_HEADER_BYTES:
        raise CorruptDataError(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    return header_len, minor


def frame_head_size(layer_count: int) -> int:
    """Bytes of a chunk frame before its first section: fixed part, section table, checksum."""
    return FRAME_HEAD.size + layer_count * SECTION_ENTRY.size + CHECKSUM.size


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise CorruptDataError(f"invalid container header: {msg}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name}")


def _depth(obj: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, todo = 0, [(obj, 0)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (list, dict)):
            deepest = max(deepest, d + 1)
            if deepest > MAX_JSON_DEPTH:
                break
            todo.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x) if isinstance(y, (list, dict)))
    return deepest


class SlotCursor:
    """Checks that frames come in file order: the header's cells in turn, each with
    one or more variants in increasing order.  Raises ``ValueError`` on a violation;
    writers report it as invalid input, readers as corrupt data."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self.num_cells = header.num_cells
        self.num_variants = len(header.variants)
        self.pos = -1
        self.last_variant = -1

    def advance(self, cell: tuple[int, int, int, int], variant: int) -> None:
        if not 0 <= variant < self.num_variants:
            raise ValueError(f"chunk {cell} names variant {variant}, the header has {self.num_variants}")
        if self.pos >= 0 and cell == self.header.cell(self.pos) and variant > self.last_variant:
            pass
        elif self.pos + 1 < self.num_cells and cell == self.header.cell(self.pos + 1):
            self.pos += 1
        else:
            want = self.header.cell(self.pos + 1) if self.pos + 1 < self.num_cells else "the index"
            raise ValueError(f"chunk {cell} variant {variant} is out of order; expected {want}")
        self.last_variant = variant

    def finish(self) -> None:
        if self.pos != self.num_cells - 1:
            raise ValueError(f"{self.num_cells - 1 - self.pos} chunk(s) of the header are missing")
