"""The public reader: random access to a container's chunks, decoded to tensors."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Sequence

import torch

from kvcodec.cache import KVCache, KVLayer
from kvcodec.chunking import DecodeRequest, decode_all, decode_sections, sections_to_read
from kvcodec.codecs import Codec, codec_class
from kvcodec.container import ContainerFile
from kvcodec.errors import CorruptDataError, InvalidInputError, UnsupportedError
from kvcodec.formats.v1 import VERSION_MAJOR, ChunkEntry, Header, LayerShape
from kvcodec.threads import DEFAULT_THREADS

ProgressFn = Callable[[Iterable[Any], int], Iterable[Any]]


@dataclass(frozen=True)
class ContainerInfo:
    """What a container's header and index say, plus sizes."""

    version: str
    dtype: str
    variants: list[dict[str, Any]]
    layers: list[LayerShape]
    num_tokens: int
    chunk_tokens: int
    chunk_layers: int
    num_chunks: int
    file_size: int
    meta: dict[str, Any] = field(repr=False)

    @property
    def codec(self) -> str:
        return self.variants[0]["codec"]

    @property
    def config(self) -> dict[str, Any]:
        return self.variants[0]["config"]

    @property
    def num_elements(self) -> int:
        return sum(s.elements for s in self.layers)

    @property
    def raw_bytes(self) -> int:
        """Bytes of the decoded tensors in their dtype."""
        return self.num_elements * getattr(torch, self.dtype).itemsize

    @property
    def bits_per_element(self) -> float:
        """Every byte of the file (headers, index, tables) per KV element, in bits."""
        return 8 * self.file_size / max(self.num_elements, 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "dtype": self.dtype, "variants": self.variants,
            "layers": [[s.heads, s.tokens, s.key_dim, s.value_dim] for s in self.layers],
            "num_tokens": self.num_tokens, "chunk_tokens": self.chunk_tokens, "chunk_layers": self.chunk_layers,
            "num_chunks": self.num_chunks, "file_size": self.file_size, "raw_bytes": self.raw_bytes,
            "num_elements": self.num_elements, "bits_per_element": self.bits_per_element,
            "ratio": self.raw_bytes / max(self.file_size, 1),
            "meta": {k: v for k, v in self.meta.items() if k not in ("token_ids", "positions")},
        }


@dataclass(repr=False)
class Chunk:
    """One decoded chunk: a token range of some layers (sliding-window layers may hold fewer tokens)."""

    index: int
    token_start: int
    token_count: int
    layers: dict[int, KVLayer]

    def __repr__(self) -> str:
        names = sorted(self.layers)
        if not names:
            span = "none"
        elif names == list(range(names[0], names[-1] + 1)):
            span = f"{names[0]}-{names[-1]}"
        else:
            span = ",".join(map(str, names))
        first = f", layer {names[0]}: {self.layers[names[0]]!r}" if names else ""
        return (f"Chunk(index={self.index}, tokens {self.token_start}-{self.token_start + self.token_count - 1}, "
                f"layers {span}{first})")


def build_codecs(header: Header) -> list[Codec]:
    """Instantiate the codec of every variant; unknown ids or bad configs name themselves.

    A file's config must be complete and canonical (what ``get_config`` writes),
    so that no decoder falls back on defaults that another version might change.
    """
    codecs = []
    for v in header.variants:
        try:
            codec = codec_class(v.codec).from_file_config(v.config)
        except UnsupportedError:
            raise
        except InvalidInputError as e:
            raise CorruptDataError(f"container's {v.codec} config is invalid: {e}") from None
        if codec.joint_sections != v.joint:
            raise CorruptDataError(f"container's {v.codec} variant {'has' if v.joint else 'lacks'} joint sections, "
                                   f"which the codec {'does not use' if v.joint else 'needs'}")
        if codec.get_config() != v.config:
            raise CorruptDataError(f"container's {v.codec} config {v.config} is not the canonical {codec.get_config()}")
        codecs.append(codec)
    return codecs


def _naming(error: Exception, source: object) -> Exception:
    """``error`` again, its message led by the file it is about when ``source`` is a path or a named file."""
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else getattr(source, "name", None)
    if not isinstance(name, str):
        return error
    return type(error)(f"{name}: {error}")


class Reader:
    """An open container.  Use :func:`kvcodec.open` to get one.

    ``info`` describes it; ``read_chunk(i)`` decodes chunk ``i`` alone (reading
    nothing else), ``read_chunk(i, layers=[j])`` only layer ``j`` of it, and
    ``decode()`` the whole cache or a selection.  ``max_bytes`` bounds every
    read and decode (SPEC.md §9.1): one that would produce or read more raises
    :class:`LimitExceededError` before allocating it.
    """

    def __init__(self, source: bytes | bytearray | memoryview | str | os.PathLike[str] | BinaryIO,
                 max_bytes: int | None = None) -> None:
        try:
            self._container = ContainerFile(source, max_bytes)
        except (CorruptDataError, UnsupportedError) as e:
            raise _naming(e, source) from None
        self.header = self._container.header
        try:
            self.codecs = build_codecs(self.header)
        except (CorruptDataError, UnsupportedError) as e:
            self._container.close()
            raise _naming(e, source) from None
        except BaseException:
            self._container.close()
            raise

    @property
    def max_bytes(self) -> int | None:
        return self._container.max_bytes

    @property
    def info(self) -> ContainerInfo:
        h = self.header
        return ContainerInfo(f"{VERSION_MAJOR}.{self._container.minor_version}", h.dtype,
                             [{"codec": v.codec, "config": v.config} for v in h.variants], list(h.layers),
                             h.max_tokens, h.chunk_tokens, h.chunk_layers, self.num_chunks,
                             self._container.file_size, dict(h.meta))

    @property
    def num_chunks(self) -> int:
        return self._container.num_chunks

    @property
    def chunks(self) -> list[ChunkEntry]:
        """The chunk index: token range, layer range, offset, length and checksum of each chunk."""
        return list(self._container.entries)

    def read_chunk(self, i: int, *, layers: Sequence[int] | None = None, device: torch.device | str | None = None,
                   backend: str = "auto", threads: int = DEFAULT_THREADS,
                   positions: Sequence[int] | None = None) -> Chunk:
        """Decode chunk ``i`` (or only ``layers`` of it); ``backend`` and ``threads`` as for :func:`kvcodec.decode`.
        ``positions`` (one per token of the chunk) moves the keys' rotary embedding to those positions, as
        :func:`kvcodec.decode` does."""
        request = self._chunk_request(i, self._request(layers=layers, device=device, backend=backend, threads=threads,
                                                       positions=positions))
        return self._decode_chunk(i, request, request.wanted)

    def _request(self, **arguments: Any) -> DecodeRequest:
        """The decode request of ``arguments`` (those of :meth:`decode`) for this container."""
        return DecodeRequest.make(max_bytes=self.max_bytes, **arguments).bind(self.header, self.codecs)

    def _chunk_request(self, i: int, request: DecodeRequest) -> DecodeRequest:
        """``request`` (bound to this container) selecting chunk ``i``."""
        e = self._container.entry(i)
        frame_layers = range(e.layer_start, e.layer_start + e.layer_count)
        absent = [l for l in request.layers or () if l not in frame_layers]
        if absent:
            raise InvalidInputError(f"chunk {i} holds layers {e.layer_start}..{frame_layers[-1]}, not {absent[0]}")
        return request.select(e.token_start, e.token_start + e.token_count, frame_layers)

    def _decode_chunk(self, i: int, request: DecodeRequest, layers: Sequence[int]) -> Chunk:
        """``layers`` (of the request's) of chunk ``i``, which the ``request`` selects."""
        e = self._container.entry(i)
        codec = self.codecs[e.variant]
        # a whole chunk is read whole, so that a joint frame's sections other than the first are checked empty
        whole = len(layers) == e.layer_count
        frame = self._container.read_frame(i, None if whole else sections_to_read(
            codec, self.header, e.token_start, e.token_count, e.layer_start, layers))
        decoded = decode_sections(request, codec, e.token_start, e.token_count, frame.sections,
                                  layer_start=e.layer_start, wanted=layers)
        chunk = Chunk(i, e.token_start, e.token_count, {layer: KVLayer(k, v) for layer, (_, k, v) in decoded.items()})
        if request.positions is not None and chunk.layers:
            names = sorted(chunk.layers)
            chunk.layers = dict(zip(names, request.moved(KVCache([chunk.layers[l] for l in names]), names).layers))
        return chunk

    def verify_checksums(self) -> None:
        """Check every section checksum of every chunk, decoding nothing; raises :class:`CorruptDataError` on the
        first mismatch (the header's and index's checksums were checked on opening)."""
        for i in range(self.num_chunks):
            self._container.read_frame(i)

    def verify(self, progress: ProgressFn | None = None, threads: int = DEFAULT_THREADS) -> None:
        """Check every checksum and decode every chunk; raises :class:`CorruptDataError` on the first fault."""
        request = self._request(threads=threads)
        indices: Iterable[int] = range(self.num_chunks)
        for i in (progress(indices, self.num_chunks) if progress else indices):
            chunk = self._chunk_request(i, request)
            self._decode_chunk(i, chunk, chunk.wanted)

    def decode(self, *, layers: Sequence[int] | None = None, chunks: Sequence[int] | None = None,
               device: torch.device | str | None = None, progress: ProgressFn | None = None,
               backend: str = "auto", threads: int = DEFAULT_THREADS,
               positions: Sequence[int] | None = None) -> KVCache:
        """Decode the cache, or the ``layers`` and ``chunks`` asked for.

        ``chunks`` are indices into :attr:`chunks`; their token ranges must join
        up.  Where a chunk is stored in several variants, the highest (best) is used.
        ``backend``, ``threads`` and ``positions`` as for :func:`kvcodec.decode`.
        """
        request = self._request(layers=layers, device=device, backend=backend, threads=threads, positions=positions)
        entries = self._select(chunks)
        held = sorted({l for _, e in entries for l in range(e.layer_start, e.layer_start + e.layer_count)})
        if entries:
            token_range = (entries[0][1].token_start, max(e.token_start + e.token_count for _, e in entries))
        else:
            token_range = (0, 0)
        request = request.select(*token_range, range(len(self.header.layers)) if chunks is None else held)
        wanted = set(request.wanted)
        starts = {(e.token_start, l) for _, e in entries for l in range(e.layer_start, e.layer_start + e.layer_count)}
        missing = sorted((t, l) for t in {e.token_start for _, e in entries} for l in wanted if (t, l) not in starts)
        if missing:
            raise InvalidInputError(f"the chunks asked for do not hold layer {missing[0][1]} at token {missing[0][0]}")

        def frames() -> Iterator[tuple[int, int, int, int, dict[int, bytes]]]:
            for i, e in (progress(entries, len(entries)) if progress else entries):
                own = [l for l in range(e.layer_start, e.layer_start + e.layer_count) if l in wanted]
                own = sections_to_read(self.codecs[e.variant], self.header, e.token_start, e.token_count, e.layer_start, own)
                if own:
                    data = self._container.read_frame(i, own)
                    yield e.variant, e.token_start, e.token_count, e.layer_start, data.sections

        return decode_all(request, frames())

    def _select(self, chunks: Sequence[int] | None) -> list[tuple[int, ChunkEntry]]:
        entries = self._container.entries
        picked = range(len(entries)) if chunks is None else sorted(set(chunks))
        if chunks is not None and not picked:
            raise InvalidInputError("no chunks selected")
        for i in picked:
            self._container.entry(i)
        best: dict[tuple[int, int], tuple[int, ChunkEntry]] = {}
        for i in picked:
            e = entries[i]
            key = (e.token_start, e.layer_start)
            if key not in best or e.variant > best[key][1].variant:
                best[key] = (i, e)
        out = [best[k] for k in sorted(best)]
        starts = sorted({(e.token_start, e.token_count) for _, e in out})
        if any(a + n != b for (a, n), (b, _) in zip(starts, starts[1:])):
            raise InvalidInputError("the chunks asked for do not cover one contiguous token range")
        return out

    def close(self) -> None:
        self._container.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_chunk_layers(reader: Reader, i: int, *, device: torch.device | str | None = None) -> Iterator[KVLayer]:
    """Chunk ``i``'s layers one at a time, in order, for engines that overlap loading with the model's layers:
    each layer is decoded on its own, except that a codec with joint sections (kvtc: SPEC.md §6.7) decodes the
    frame once, at the first layer, instead of once per layer."""
    request = reader._chunk_request(i, reader._request(device=device))
    if reader.codecs[reader.chunks[i].variant].joint_sections:
        chunk = reader._decode_chunk(i, request, request.wanted)
        for l in request.wanted:
            yield chunk.layers.pop(l)
    else:
        for l in request.wanted:
            yield reader._decode_chunk(i, request, [l]).layers[l]
