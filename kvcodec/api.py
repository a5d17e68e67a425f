"""The Python API: encode, decode, save, load and open."""

from __future__ import annotations

import os
from typing import Any, BinaryIO, Iterable, Iterator, Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.chunking import DEFAULT_CHUNK_TOKENS, DecodeRequest, decode_all, encode_frames, make_header
from kvcodec.codecs import Codec, get_codec
from kvcodec.codecs.base import check_backend
from kvcodec.container import iter_frames, write_container
from kvcodec.errors import InvalidInputError
from kvcodec.files import atomic_writer
from kvcodec.reader import ProgressFn, Reader, build_codecs
from kvcodec.threads import DEFAULT_THREADS, check_threads


def _codecs(codec: str | Codec | Sequence[Codec], config: dict[str, Any]) -> list[Codec]:
    if isinstance(codec, str):
        return [get_codec(codec, **config)]
    if config:
        raise InvalidInputError("pass either Codec instances or a codec id with options, not both")
    codecs = [codec] if isinstance(codec, Codec) else list(codec)
    if not codecs or not all(isinstance(c, Codec) for c in codecs):
        raise InvalidInputError("codec must be a codec id, a Codec, or a non-empty list of Codecs")
    return codecs


def iter_encode(kv: KVCache, codec: str | Codec | Sequence[Codec] = "raw", *,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, chunk_layers: int | None = None,
                progress: ProgressFn | None = None, backend: str = "auto", threads: int = DEFAULT_THREADS,
                meta: dict[str, Any] | None = None, **config: Any) -> Iterator[bytes]:
    """Encode ``kv`` and yield the container piece by piece (one chunk frame at a time).

    ``codec`` is a registered codec id (its options as keyword arguments), a
    :class:`Codec`, or a list of codecs ordered from smallest to best: a
    multi-level container that stores every chunk once per codec, so a reader
    can fetch each chunk at the level its bandwidth allows.  Chunks hold
    ``chunk_tokens`` tokens of ``chunk_layers`` layers (default: all layers).
    ``backend`` (``"auto"``, ``"cpu"``, ``"triton"`` or ``"nvdec"``) picks the
    implementation of codecs that have a GPU path; ``"auto"`` runs cachegen's Triton
    kernels for CUDA tensors, ``"nvdec"`` (decoding only) kvfetcher's NVDEC decoder.
    The same input and config give the same bytes, whichever backend makes them.
    ``threads`` is how many CPU threads the encode uses (see :mod:`kvcodec.threads`; default 1, so that small
    per-section work never waits on a busy machine's cores); it does not change the bytes either.
    ``meta`` adds keys of the caller's to the header's ``meta`` (SPEC.md §5: readers ignore keys they do not know);
    it may not name the keys the cache itself sets (``model``, ``token_ids``, ``rope``, ``positions``).
    """
    if not isinstance(kv, KVCache):
        raise InvalidInputError(f"encode takes a kvcodec.KVCache, not {type(kv).__name__}; build one with "
                                "KVCache(layers), KVCache.from_hf(cache) or KVCache.load_safetensors(path)")
    check_threads(threads)
    codecs = [c.for_cache(kv) for c in _codecs(codec, config)]
    check_backend(codecs, backend)
    header = make_header(kv, codecs, chunk_tokens, chunk_layers, meta)
    frames: Iterable[Any] = encode_frames(kv, header, codecs, backend, threads)
    if progress:
        frames = progress(frames, header.num_cells * len(codecs))
    return write_container(header, frames)


def encode(kv: KVCache, codec: str | Codec = "raw", **options: Any) -> bytes:
    """Encode ``kv`` to container bytes; options as for :func:`iter_encode`."""
    return b"".join(iter_encode(kv, codec, **options))


def save(path: str | os.PathLike[str], kv: KVCache, codec: str | Codec = "raw", **options: Any) -> int:
    """Encode ``kv`` into the file ``path``, streaming; returns the bytes written.

    The file appears atomically: it is written beside ``path`` under a temporary
    name, flushed to disk and renamed, so a crash never leaves a partial file.  It gets
    the mode a plain ``open()`` would give it under the process umask.
    """
    written = 0
    with atomic_writer(path) as f:  # first, so that an unwritable path fails before any work
        for piece in iter_encode(kv, codec, **options):
            f.write(piece)
            written += len(piece)
    return written


def open(source: bytes | bytearray | memoryview | str | os.PathLike[str] | BinaryIO, *,  # noqa: A001
         max_bytes: int | None = None) -> Reader:
    """Open a container for random access (bytes, a path or a seekable binary file); ``max_bytes`` as for
    :func:`decode`, for every read and decode of the returned reader."""
    return Reader(source, max_bytes)


def decode(data: Any, *, device: torch.device | str | None = None, layers: Sequence[int] | None = None,
           chunks: Sequence[int] | None = None, progress: ProgressFn | None = None, backend: str = "auto",
           threads: int = DEFAULT_THREADS, positions: Sequence[int] | None = None,
           max_bytes: int | None = None) -> KVCache:
    """Decode a container to a :class:`KVCache`.

    ``data`` is bytes, a path, a seekable binary file, or an iterable of byte
    pieces as they arrive (decoded as a stream, chunk by chunk).  ``layers``
    and ``chunks`` select part of the cache (``chunks`` needs random access).
    ``backend`` and ``threads`` as for :func:`iter_encode`, for the output ``device``.  A ``device`` this
    machine lacks raises :class:`~kvcodec.errors.DeviceUnavailableError` before anything is read.
    ``positions`` (one per token of the decoded range) moves the keys' rotary embedding to those positions
    (:func:`kvcodec.positions.reposition`): the cache must have ``rope="post"`` keys and a known rotary
    setting (a kvtc container's calibration, or one installed for its model).
    ``max_bytes`` (for untrusted input) refuses, with :class:`LimitExceededError` and before allocating it,
    a decode whose output as the header declares it, or any header, index or section it reads, is larger.
    """
    if isinstance(data, (bytes, bytearray, memoryview, str, os.PathLike)) or hasattr(data, "seek"):
        with Reader(data, max_bytes) as reader:
            return reader.decode(layers=layers, chunks=chunks, device=device, progress=progress, backend=backend,
                                 threads=threads, positions=positions)
    request = DecodeRequest.make(device=device, threads=threads, backend=backend, layers=layers, positions=positions,
                                 max_bytes=max_bytes)
    if chunks is not None:
        raise InvalidInputError("chunk selection needs random access; pass bytes, a path or a seekable file")
    header, frames = iter_frames(data, max_bytes)
    request = request.bind(header, build_codecs(header)).select(0, header.max_tokens, range(len(header.layers)))
    rows: Iterable[Any] = ((h.variant, h.token_start, h.token_count, h.layer_start,
                            {h.layer_start + j: s for j, s in enumerate(sections)})
                           for h, sections in _best(frames, len(header.variants)))
    if progress:
        rows = progress(rows, header.num_cells)
    return decode_all(request, rows)


def _best(frames: Iterable[Any], num_variants: int) -> Iterator[Any]:
    """Of the variants of each chunk (consecutive, in increasing order), keep the last: the best.

    A chunk in the highest variant is passed on at once, since nothing better can follow; only a lower one
    waits for the next chunk's head.  (Holding every chunk back made a streamed decode trail the link by two
    chunks instead of one.)"""
    held = None
    for frame in frames:
        if held is not None and held[0].cell != frame[0].cell:
            yield held
        held = frame
        if frame[0].variant == num_variants - 1:
            yield frame
            held = None
    if held is not None:
        yield held


def load(path: str | os.PathLike[str], **options: Any) -> KVCache:
    """Decode the container file at ``path``; options as for :func:`decode`."""
    return decode(os.fspath(path), **options)
