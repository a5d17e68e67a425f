"""Structure-aware mutations of a container: header JSON, frame heads, section tables, the index, and the
fields inside each codec's sections (SPEC.md §10 and spec/).  Each mutator takes a random source and the parts of a
valid container and returns mutated parts, which :func:`kvcodec.tools.fuzz.container.seal` turns into a file whose
checksums all pass."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvcodec.codecs.kvfetcher.section import HEAD as KVF_HEAD
from kvcodec.codecs.lmcache_cachegen import LANE_TOKENS
from kvcodec.codecs.registry import get_codec
from kvcodec.formats.v1 import Header
from kvcodec.tools.fuzz.container import ContainerParts, implied_index

# values around every boundary the parsers and decoders check
INTERESTING = [0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 143, 144, 145, 255, 256, 257, 1023,
               1024, 4095, 4096, 4097, 8191, 8192, 8193, 65535, 65536, 1 << 20, (1 << 20) + 1, 1 << 24, 1 << 26,
               (1 << 26) + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 36, (1 << 63) - 1]
ODD_JSON = [None, True, False, -1, 1.5, 1e300, "x", "", [], {}, [1, 2], {"a": 1}, -(1 << 70), 1 << 70]


@dataclass(frozen=True)
class Field:
    """A named byte range of a section: ``fmt`` is its struct format ('' for opaque bytes)."""

    name: str
    offset: int
    size: int
    fmt: str = ""


@dataclass
class Seed:
    """A valid container and what its header says, for mutators that need section shapes."""

    name: str
    data: bytes
    parts: ContainerParts
    header: Header

    def section_context(self, frame: int, j: int) -> tuple[str, dict[str, Any], tuple[int, int, int, int], int]:
        """(codec id, config, (heads, tokens, key_dim, value_dim), number of layers) of a seed section."""
        f = self.parts.frames[frame]
        layer = f.layer_start + j
        v = self.header.variants[f.variant]
        lo, hi = self.header.local_range(layer, f.token_start, f.token_count)
        s = self.header.layers[layer]
        return v.codec, v.config, (s.heads, hi - lo, s.key_dim, s.value_dim), len(self.header.layers)


def _int(rng: random.Random) -> int:
    x = rng.choice(INTERESTING)
    return x + rng.choice((-1, 0, 0, 0, 1)) if x > 1 else x


def _set_field(rng: random.Random, data: bytes, f: Field) -> bytes:
    buf = bytearray(data)
    if f.fmt in ("<e", "<f"):
        value = struct.pack(f.fmt, rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 65504.0, 1e-7,
                                               -65504.0]))
    elif f.fmt:
        bits = 8 * struct.calcsize(f.fmt)
        value = struct.pack(f.fmt, _int(rng) & ((1 << bits) - 1))
    else:
        n = min(f.size, rng.randint(1, 8))
        at = f.offset + rng.randrange(f.size - n + 1)
        buf[at:at + n] = bytes(rng.randrange(256) for _ in range(n))
        return bytes(buf)
    buf[f.offset:f.offset + len(value)] = value
    return bytes(buf)


# ------------------------------------------------------------------------------------------ section field maps

def _cachegen_fields(config: dict[str, Any], shape: tuple[int, int, int, int], nl: int, data: bytes) -> list[Field]:
    codec = get_codec("cachegen", **config)
    h, t, dk, dv = shape
    out, pos = [], 0
    for part, d in (("key", dk), ("value", dv)):
        c = h * d
        lanes = -(-c // codec.lane_channels) * -(-t // codec.lane_tokens)
        out.append(Field(f"{part} channel mean", pos + 2 * (c // 2), 2, "<e"))
        pos += 2 * c
        out += [Field(f"{part} step code", pos, c), Field(f"{part} table index", pos + c, c, "B")]
        pos += 2 * c
        if codec.group > 1:
            out.append(Field(f"{part} anchor table index", pos, c, "B"))
            pos += c
        if part == "value":
            out.append(Field("token step code", pos, h * t))
            pos += h * t
        out += [Field(f"{part} lane length", pos + 2 * k, 2, "<H") for k in range(min(lanes, 8))]
        lengths = np.frombuffer(data[pos:pos + 2 * lanes], "<u2").astype(np.int64) if pos + 2 * lanes <= len(data) else []
        pos += 2 * lanes
        words = 4 * int(np.sum(lengths))
        if words:
            out.append(Field(f"{part} lane words", pos, words))
        pos += words
    if pos < len(data):
        out.append(Field("sink tokens", pos, len(data) - pos, "<e"))
    return out


def _kvfetcher_fields(config: dict[str, Any], shape: tuple[int, int, int, int], nl: int, data: bytes) -> list[Field]:
    names = [("bits", 4, "B"), ("flags", 5, "B"), ("frame rows", 6, "<H"), ("picture rows", 8, "<H"),
             ("picture cols", 10, "<H"), ("frame count", 12, "<H"), ("stream length", 14, "<I"),
             ("codes digest", 18, "<Q"), ("exact tokens", 26, "<H")]
    out = [Field(n, o, struct.calcsize(f), f) for n, o, f in names]
    (stream_len,) = struct.unpack_from("<I", data, 14)
    start = len(data) - stream_len
    if KVF_HEAD.size < start:
        out.append(Field("scale block", KVF_HEAD.size, start - KVF_HEAD.size))
    if stream_len:
        out += [Field("HEVC parameter sets", start, min(stream_len, 120)), Field("HEVC stream", start, stream_len)]
    return out


def _kivi_fields(config: dict[str, Any], shape: tuple[int, int, int, int], nl: int, data: bytes) -> list[Field]:
    h, t, dk, dv = shape
    scales = 2 * (2 * h * -(-t // config["group"]) * dk + 2 * h * t)
    return [Field("codes", 0, len(data) - scales), Field("scale or zero", len(data) - scales + 2 * (scales // 4), 2, "<e"),
            Field("last value zero", len(data) - 2, 2, "<e")]


def _fp8_fields(config: dict[str, Any], shape: tuple[int, int, int, int], nl: int, data: bytes) -> list[Field]:
    return [Field("fp8 byte", len(data) // 2, 1, "B"), Field("fp8 bytes", 0, len(data))]


def _zstd_fields(config: dict[str, Any], shape: tuple[int, int, int, int], nl: int, data: bytes) -> list[Field]:
    out = [Field("frame header descriptor", 4, 1, "B"), Field("frame header", 5, min(9, len(data) - 5))]
    fhd = data[4]
    pos = 5 + (0 if fhd & 0x20 else 1) + (0, 1, 2, 4)[fhd & 3] + ((0, 2, 4, 8)[fhd >> 6] if (fhd >> 6) or (fhd & 0x20)
                                                                    else 0)
    while pos + 3 <= len(data):
        out.append(Field("block header", pos, 3))
        b = int.from_bytes(data[pos:pos + 3], "little")
        pos += 3 + (1 if (b >> 1) & 3 == 1 else b >> 3)
        if b & 1:
            break
    return out


def _lmcache_fields(config: dict[str, Any], shape: tuple[int, int, int, int], nl: int, data: bytes) -> list[Field]:
    codec = get_codec("lmcache-cachegen", **config)
    h, t, dk, dv = shape
    e = 2  # seeds are float16
    lanes = -(-t // LANE_TOKENS) * h * (dk + dv)
    tables = 2 * (h * dk * (codec.table_bins(nl, True) + 1) + h * dv * (codec.table_bins(nl, False) + 1))
    lengths = 2 * t * e + tables
    return [Field("key scale", 0, e, "<e"), Field("value scale", t * e, e, "<e"),
            Field("CDF entry", 2 * t * e + 2 * (tables // 4), 2, "<H"), Field("CDF tables", 2 * t * e, tables),
            Field("lane length", lengths, 4, "<I"), Field("lane words", lengths + 4 * lanes, len(data) - lengths - 4 * lanes)]


SECTION_FIELDS: dict[str, Callable[..., list[Field]]] = {
    "cachegen": _cachegen_fields, "kvfetcher": _kvfetcher_fields, "kivi": _kivi_fields, "fp8": _fp8_fields,
    "zstd": _zstd_fields, "lmcache-cachegen": _lmcache_fields}


# ------------------------------------------------------------------------------------------ mutators

def _json_mutator(fn: Callable[[random.Random, ContainerParts, Seed, dict[str, Any]], ContainerParts]) -> Callable[..., ContainerParts]:
    """A mutator of the parsed header; it leaves alone a header an earlier mutation left unparsable."""
    def wrapped(rng: random.Random, c: ContainerParts, seed: Seed) -> ContainerParts:
        try:
            obj = json.loads(c.header)
        except (ValueError, RecursionError):
            return c
        if not isinstance(obj, dict) or not isinstance(obj.get("layers"), list) or not obj["layers"] or \
                not isinstance(obj.get("variants"), list) or not obj["variants"] or not isinstance(obj.get("meta"), dict):
            return c
        return fn(rng, c, seed, obj)

    wrapped.__doc__ = fn.__doc__
    return wrapped


def _with_header(c: ContainerParts, obj: Any) -> ContainerParts:
    c.header = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return c


@_json_mutator
def header_shape(rng: random.Random, c: ContainerParts, seed: Seed, obj: dict[str, Any]) -> ContainerParts:
    layer = rng.randrange(len(obj["layers"]))
    if not isinstance(obj["layers"][layer], list) or len(obj["layers"][layer]) != 4:
        return c
    obj["layers"][layer][rng.randrange(4)] = _int(rng) if rng.random() < 0.9 else rng.choice(ODD_JSON)
    return _with_header(c, obj)


@_json_mutator
def header_grid(rng: random.Random, c: ContainerParts, seed: Seed, obj: dict[str, Any]) -> ContainerParts:
    key = rng.choice(["chunk_tokens", "chunk_layers", "dtype"])
    if key == "dtype":
        obj[key] = rng.choice(["float32", "float16", "bfloat16", "int8", 16])
    else:
        obj[key] = _int(rng) if rng.random() < 0.9 else rng.choice(ODD_JSON)
    return _with_header(c, obj)


@_json_mutator
def header_layers(rng: random.Random, c: ContainerParts, seed: Seed, obj: dict[str, Any]) -> ContainerParts:
    """Drop, repeat or multiply the layer list (2**k layers of 2**26 tokens: the issue's reproducer)."""
    kind = rng.randrange(3)
    if kind == 0:
        del obj["layers"][rng.randrange(len(obj["layers"]))]
    elif kind == 1:
        obj["layers"].insert(rng.randrange(len(obj["layers"])), list(rng.choice(obj["layers"])))
    else:
        obj["layers"] = [[1, rng.choice([1 << 20, 1 << 24, 1 << 26]), 1, 1]] * rng.choice([1, 64, 4096])
        obj["chunk_tokens"] = 1
    return _with_header(c, obj)


@_json_mutator
def header_config(rng: random.Random, c: ContainerParts, seed: Seed, obj: dict[str, Any]) -> ContainerParts:
    v = rng.choice(obj["variants"])
    if not isinstance(v, dict) or not isinstance(v.get("config"), dict):  # an earlier text mutation broke it
        return c
    kind = rng.randrange(5)
    if kind == 0 and v["config"]:
        key = rng.choice(sorted(v["config"]))
        old = v["config"][key]
        v["config"][key] = (_int(rng) if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.8
                            else rng.choice(ODD_JSON + [not old if isinstance(old, bool) else old]))
    elif kind == 1 and v["config"]:
        del v["config"][rng.choice(sorted(v["config"]))]
    elif kind == 2:
        v["config"]["unknown"] = 1
    elif kind == 3:
        v["codec"] = rng.choice(["raw", "kivi", "fp8", "zstd", "cachegen", "lmcache-cachegen", "kvfetcher", "nope"])
    else:
        obj["variants"] = obj["variants"][:-1] if len(obj["variants"]) > 1 and rng.random() < 0.5 else \
            obj["variants"] + [dict(rng.choice(obj["variants"]))]
    return _with_header(c, obj)


@_json_mutator
def header_meta(rng: random.Random, c: ContainerParts, seed: Seed, obj: dict[str, Any]) -> ContainerParts:
    kind = rng.randrange(4)
    if kind == 0:  # deep nesting (the RecursionError), as text: json.dumps would recurse itself
        depth = rng.choice([65, 100, 1000, 3000, 100000])
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
        c.header = text[:-1].encode() + b',"zz":' + b"[" * depth + b"]" * depth + b"}"
        return c
    meta = obj["meta"]
    if kind == 1:
        meta["token_ids"] = list(range(rng.choice([0, 1, seed.header.max_tokens - 1, seed.header.max_tokens])))
    elif kind == 2:
        meta[rng.choice(["model", "rope", "positions"])] = rng.choice(ODD_JSON + ["pre", "post", "HuggingFaceTB/x"])
    else:
        obj["meta"] = rng.choice(ODD_JSON)
    return _with_header(c, obj)


def header_text(rng: random.Random, c: ContainerParts, seed: Seed) -> ContainerParts:
    """Byte-level damage to the JSON text, or another major/minor version."""
    buf = bytearray(c.header)
    kind = rng.randrange(4)
    if kind == 0:
        buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == 1:
        at = rng.randrange(len(buf))
        del buf[at:at + rng.randint(1, 16)]
    elif kind == 2:
        at = rng.randrange(len(buf))
        buf[at:at] = rng.choice([b"[", b"{", b'"', b"\\", b"\xff", b"1e999", b"NaN", b" " * 10, b'"a":1,'])
    else:
        c.major, c.minor = rng.choice([(1, 7), (2, 0), (0, 1), (1, 65535)])
    c.header = bytes(buf)
    return c


def frame_head(rng: random.Random, c: ContainerParts, seed: Seed) -> ContainerParts:
    f = rng.choice(c.frames)
    name = rng.choice(["variant", "token_start", "token_count", "layer_start", "layer_count"])
    setattr(f, name, _int(rng))
    return c


def frame_table(rng: random.Random, c: ContainerParts, seed: Seed) -> ContainerParts:
    """A section length in the table that is not the section's, or sections moved between frames and layers."""
    f = rng.choice(c.frames)
    if not f.sections:
        return c
    j = rng.randrange(len(f.sections))
    kind = rng.randrange(4)
    if kind == 0:
        f.lengths[j] = rng.choice([len(f.sections[j]) + 1, len(f.sections[j]) - 1, 0, _int(rng)])
    elif kind == 1:
        donor = [s for g in c.frames for s in g.sections]
        f.sections[j] = rng.choice(donor)
    elif kind == 2:
        f.sections[j] = f.sections[j][:rng.randrange(len(f.sections[j]) + 1)]
    else:
        f.sections.append(f.sections[j]) if rng.random() < 0.5 else f.sections.pop(j)
    return c


def frame_order(rng: random.Random, c: ContainerParts, seed: Seed) -> ContainerParts:
    kind = rng.randrange(4)
    i = rng.randrange(len(c.frames))
    if kind == 0:
        c.frames.insert(i, c.frames[i].copy())
    elif kind == 1 and len(c.frames) > 1:
        del c.frames[i]
    elif kind == 2:
        j = rng.randrange(len(c.frames))
        c.frames[i], c.frames[j] = c.frames[j], c.frames[i]
    else:
        c.tail = rng.choice([b"\x00", b"KVCK", b"junk" * 10])
    return c


def index_entry(rng: random.Random, c: ContainerParts, seed: Seed) -> ContainerParts:
    entries = implied_index(c)
    if not entries:
        return c
    i = rng.randrange(len(entries))
    e = entries[i]
    name = rng.choice(["variant", "token_start", "token_count", "layer_start", "layer_count", "offset", "length",
                       "checksum"])
    bits = 64 if name in ("offset", "length", "checksum") else 32
    entries[i] = type(e)(**{**e.__dict__, name: _int(rng) & ((1 << bits) - 1)})
    c.index = entries if rng.random() < 0.8 else entries[:-1]
    return c


def _pick_section(rng: random.Random, c: ContainerParts, seed: Seed) -> tuple[int, int]:
    fi = rng.randrange(len(seed.parts.frames))
    known = len(seed.parts.frames[fi].sections)  # sections whose shape the seed's header gives
    candidates = [j for j, s in enumerate(c.frames[fi].sections[:known]) if s] if fi < len(c.frames) else []
    return fi, rng.choice(candidates) if candidates else -1


def section_field(rng: random.Random, c: ContainerParts, seed: Seed) -> ContainerParts:
    """Set a codec field (a lane length, a step code, a table index, a head field, an HEVC parameter set, ...)."""
    fi, j = _pick_section(rng, c, seed)
    if j < 0:
        return c
    codec, config, shape, nl = seed.section_context(fi, j)
    data = c.frames[fi].sections[j]
    try:
        fields = SECTION_FIELDS.get(codec, _fp8_fields)(config, shape, nl, data)
    except (IndexError, ValueError, struct.error):  # an earlier mutation moved or cut the section: no map
        fields = _fp8_fields(config, shape, nl, data)
    fields = [f for f in fields if f.size > 0 and f.offset >= 0 and f.offset + f.size <= len(data)]
    if fields:
        c.frames[fi].sections[j] = _set_field(rng, data, rng.choice(fields))
    return c


def section_bytes(rng: random.Random, c: ContainerParts, seed: Seed) -> ContainerParts:
    """Generic damage: bytes overwritten, an aligned integer set, the section cut or grown."""
    fi, j = _pick_section(rng, c, seed)
    if j < 0:
        return c
    data = bytearray(c.frames[fi].sections[j])
    kind = rng.randrange(4)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1 and len(data) >= 4:
        at = rng.randrange(len(data) - 3)
        data[at:at + 4] = struct.pack("<I", _int(rng) & 0xFFFFFFFF)
    elif kind == 2:
        del data[rng.randrange(len(data)):][:rng.randint(1, 64)]
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    c.frames[fi].sections[j] = bytes(data)
    return c


def section_splice(rng: random.Random, c: ContainerParts, seed: Seed, donors: list[bytes] = []) -> ContainerParts:  # noqa: B006
    """Replace the HEVC stream of a kvfetcher section by a donor's (another geometry) or graft a donor's bytes."""
    fi, j = _pick_section(rng, c, seed)
    if j < 0 or not donors:
        return c
    data = c.frames[fi].sections[j]
    donor = rng.choice(donors)
    codec = seed.section_context(fi, j)[0]
    if codec == "kvfetcher" and len(data) >= KVF_HEAD.size:
        (stream_len,) = struct.unpack_from("<I", data, 14)
        head = bytearray(data[:max(len(data) - stream_len, KVF_HEAD.size)])
        head[14:18] = struct.pack("<I", len(donor))
        c.frames[fi].sections[j] = bytes(head) + donor
    else:
        at = rng.randrange(len(data))
        c.frames[fi].sections[j] = data[:at] + donor[:len(data) - at]
    return c


MUTATORS: dict[str, Callable[..., ContainerParts]] = {
    "header-shape": header_shape, "header-grid": header_grid, "header-layers": header_layers,
    "header-config": header_config, "header-meta": header_meta, "header-text": header_text,
    "frame-head": frame_head, "frame-table": frame_table, "frame-order": frame_order, "index-entry": index_entry,
    "section-field": section_field, "section-bytes": section_bytes, "section-splice": section_splice,
}
# section internals are where the decoders' own checks live: they get half of all mutations
WEIGHTS = {name: (4 if name.startswith("section-field") else 2 if name.startswith("section") else 1) for name in MUTATORS}


def mutate(rng: random.Random, seed: Seed, donors: list[bytes]) -> tuple[str, ContainerParts]:
    """One to three mutations of ``seed``; returns their names and the mutated parts."""
    c = seed.parts.copy()
    names = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        name = rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        fn = MUTATORS[name]
        c = fn(rng, c, seed, donors) if name == "section-splice" else fn(rng, c, seed)
        names.append(name)
    return "+".join(names), c
