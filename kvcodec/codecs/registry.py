"""The codec registry: built-in codecs plus those other packages declare under
the entry-point group ``kvcodec.codecs`` (``name = "package.module:CodecClass"``)."""

from __future__ import annotations

import json
import re
from importlib.metadata import entry_points
from typing import Any, Sequence

from kvcodec.codecs.base import Codec
from kvcodec.errors import InvalidInputError, UnknownCodecError

ENTRY_POINT_GROUP = "kvcodec.codecs"
_registry: dict[str, type[Codec]] = {}
_entry_points_loaded = False
# numbers JSON does not spell (".5", "5.", "+0.5"), which a person writes for a rate such as kvtc's bits=
DECIMAL = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Register ``cls`` under its ``codec_id`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise InvalidInputError(f"{cls!r} is not a kvcodec.Codec subclass")
    _registry[cls.codec_id] = cls
    return cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _registry:
            register_codec(ep.load())


def codec_class(codec_id: str) -> type[Codec]:
    """The class registered as ``codec_id``."""
    if codec_id not in _registry:
        _load_entry_points()
    try:
        return _registry[codec_id]
    except KeyError:
        raise UnknownCodecError(f"unknown codec {codec_id!r}; registered: {', '.join(list_codecs())}") from None


def get_codec(codec_id: str, **config: Any) -> Codec:
    """An instance of codec ``codec_id`` built from ``config``."""
    return codec_class(codec_id).from_config(config)


def list_codecs() -> list[str]:
    """Ids of every registered codec, entry points included."""
    _load_entry_points()
    return sorted(_registry)


def installed_rotary(model: str | None) -> Sequence[Any] | None:
    """The rotary setting of ``model``'s layers that a registered codec has installed on this machine
    (:meth:`Codec.installed_rotary`), else None."""
    for codec_id in list_codecs():
        rotary = codec_class(codec_id).installed_rotary(model)
        if rotary is not None:
            return rotary
    return None


def parse_spec(spec: str, sets: Sequence[str] = (), *, source: str = "codec") -> tuple[str, dict[str, Any]]:
    """The codec id and options of ``ID[:key=value,...]`` plus more ``key=value`` ``sets`` (values read as JSON
    where they parse, else as decimal numbers, else as strings), e.g. ``"kvtc:level=0"``, ``"kvtc:bits=.5"``.  An option given twice is an error (no silent
    precedence); ``source`` names where the spec came from in messages."""
    codec_id, _, inline = spec.partition(":")
    options: dict[str, Any] = {}
    given: dict[str, str] = {}
    for item, where in [(s, f"{source} {spec}") for s in inline.split(",") if s] + [(s, f"--set {s}") for s in sets]:
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise InvalidInputError(f"codec option {item!r} ({where}) must look like key=value")
        if key in given:
            raise InvalidInputError(f"codec option {key!r} is given twice: {given[key]} and {where}")
        given[key] = where
        try:
            options[key] = json.loads(val.strip())
        except ValueError:
            options[key] = float(val) if DECIMAL.fullmatch(val.strip()) else val.strip()
    return codec_id.strip(), options


def codec_from_spec(spec: str) -> Codec:
    """The codec ``ID[:key=value,...]`` names (:func:`parse_spec`)."""
    codec_id, options = parse_spec(spec)
    return get_codec(codec_id, **options)
