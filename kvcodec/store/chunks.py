"""What a store's chunks are: the shape an engine holds (:class:`ChunkShape`) and a chunk read from a tier and
checked (:class:`FetchedChunk`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.codecs import Codec
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.formats.v1 import Header, LayerShape


@dataclass(frozen=True)
class ChunkShape:
    """What the engine's memory holds per token: ``layers`` layers of ``heads`` heads with ``key_dim`` and
    ``value_dim`` channels in ``dtype`` (a torch dtype name).  A store given one serves only chunks of exactly
    this shape, and bounds every decode by their size."""

    layers: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if not all(isinstance(n, int) and n > 0 for n in (self.layers, self.heads, self.key_dim, self.value_dim)):
            raise InvalidInputError(f"a chunk shape needs positive integer sizes, not {self}")
        if not isinstance(getattr(torch, str(self.dtype), None), torch.dtype):
            raise InvalidInputError(f"dtype must name a torch dtype, not {self.dtype!r}")

    def output_bytes(self, tokens: int) -> int:
        itemsize = getattr(torch, self.dtype).itemsize
        return self.layers * self.heads * tokens * (self.key_dim + self.value_dim) * itemsize

    def check(self, header: Header, tokens: int) -> None:
        """Raise :class:`CorruptDataError` unless ``header`` declares ``tokens`` tokens of this shape."""
        want = (self.heads, tokens, self.key_dim, self.value_dim)
        got = [(s.heads, s.tokens, s.key_dim, s.value_dim) for s in header.layers]
        if header.dtype != self.dtype or len(got) != self.layers or any(g != want for g in got):
            first = got[0] if got else None
            raise CorruptDataError(f"the chunk holds {len(got)} layers of (heads, tokens, key_dim, value_dim) {first} "
                                   f"in {header.dtype}; the engine expects {self.layers} of {want} in {self.dtype}")

    @classmethod
    def of_header(cls, header: Header) -> ChunkShape:
        """The shape of the layers ``header`` declares (all alike; else the chunk is corrupt)."""
        return cls._of(header.layers, header.dtype, CorruptDataError)

    @classmethod
    def of(cls, kv: KVCache) -> ChunkShape:
        """The shape of ``kv``'s layers (all alike)."""
        return cls._of(kv.shapes, str(kv.dtype).removeprefix("torch."), InvalidInputError)

    @classmethod
    def _of(cls, layers: Sequence[LayerShape], dtype: str, error: type[Exception]) -> ChunkShape:
        shapes = {(s.heads, s.key_dim, s.value_dim) for s in layers}
        if len(shapes) != 1:
            raise error(f"the layers differ in shape: {sorted(shapes)}")
        (h, kd, vd), = shapes
        return cls(len(layers), h, kd, vd, dtype)


@dataclass
class FetchedChunk:
    """A chunk read from a tier and checked once (:meth:`ChunkSource.check`): its container bytes
    (authentication tag removed), where they came from, its token range, and what the check parsed: the header,
    the codec and every layer's section, checksums verified, so that decoding reads nothing twice."""

    key: str
    tier: str
    start: int
    end: int
    data: bytes
    header: Header | None = None
    codec: Codec | None = None
    sections: dict[int, bytes] = field(default_factory=dict, repr=False)
