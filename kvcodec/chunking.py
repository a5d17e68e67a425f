"""How a :class:`KVCache` maps onto container chunks and sections, and back."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch

from kvcodec.cache import SUPPORTED_DTYPES, KVCache
from kvcodec.codecs import Codec, LayerContext
from kvcodec.codecs.base import check_backend
from kvcodec.codecs.registry import installed_rotary
from kvcodec.container import Frame
from kvcodec.container.frames import check_limit
from kvcodec.devices import resolve_device
from kvcodec.errors import CorruptDataError, InvalidInputError, KVCodecError
from kvcodec.formats.v1 import Header, Variant
from kvcodec.positions import reposition
from kvcodec.threads import DEFAULT_THREADS, check_threads, coding

DEFAULT_CHUNK_TOKENS = 256
T = TypeVar("T")


def make_header(kv: KVCache, codecs: Sequence[Codec], chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                chunk_layers: int | None = None, extra_meta: dict[str, Any] | None = None) -> Header:
    """The header describing ``kv`` encoded with ``codecs`` (one variant each), with the caller's ``extra_meta``
    keys beside the cache's own."""
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InvalidInputError(f"chunk_tokens must be a positive integer, not {chunk_tokens!r}")
    meta = kv.meta
    if extra_meta:
        clash = sorted(set(extra_meta) & {"model", "token_ids", "rope", "positions"})
        if clash or not all(isinstance(k, str) for k in extra_meta):
            raise InvalidInputError(f"meta keys must be strings other than the cache's own; {clash or list(extra_meta)} "
                                    "are not")
        meta = {**meta, **extra_meta}
    header = Header(
        dtype=SUPPORTED_DTYPES[kv.dtype],
        layers=tuple(kv.shapes),
        variants=tuple(Variant(c.codec_id, c.get_config(), c.joint_sections) for c in codecs),
        chunk_tokens=chunk_tokens,
        chunk_layers=kv.num_layers if chunk_layers is None else chunk_layers,
        meta=meta,
    )
    header.validate()
    return header


def header_positions(header: Header) -> Sequence[int]:
    """The position id of each token of the longest layer: the ``positions`` metadata, else the token's index."""
    return header.meta.get("positions") or range(header.max_tokens)


def layer_context(header: Header, layer: int, token_range: tuple[int, int], device: torch.device,
                  backend: str = "auto", threads: int = DEFAULT_THREADS) -> LayerContext:
    """The context of ``layer``'s section covering ``token_range`` of its own token axis."""
    s = header.layers[layer]
    lo, hi = token_range
    shape = type(s)(s.heads, hi - lo, s.key_dim, s.value_dim)
    shift = header.max_tokens - s.tokens
    return LayerContext(layer, len(header.layers), shape, getattr(torch, header.dtype), device,
                        header.meta.get("model"), lo, backend, header.meta.get("rope"),
                        tuple(header_positions(header)[lo + shift:hi + shift]), threads, s.tokens if shift else 0)


def filled_layers(header: Header, token_start: int, token_count: int, layer_start: int) -> list[int]:
    """The layers of the frame at ``(token_start, layer_start)`` that hold tokens in it."""
    layer_end = min(layer_start + header.chunk_layers, len(header.layers))
    return [l for l in range(layer_start, layer_end) if header.local_range(l, token_start, token_count)[1] >
            header.local_range(l, token_start, token_count)[0]]


def sections_to_read(codec: Codec, header: Header, token_start: int, token_count: int, layer_start: int,
                     layers: Sequence[int]) -> list[int]:
    """The sections of a frame that decoding ``layers`` of it needs: those layers' own, or for a codec with
    joint sections the one section that holds them all (SPEC.md §6.7)."""
    if not codec.joint_sections:
        return list(layers)
    filled = filled_layers(header, token_start, token_count, layer_start)
    return filled[:1] if filled and any(l in filled for l in layers) else []


def encode_frames(kv: KVCache, header: Header, codecs: Sequence[Codec], backend: str = "auto",
                  threads: int = DEFAULT_THREADS) -> Iterator[Frame]:
    """Encode every chunk of ``kv`` with every codec, in file order, on ``threads`` CPU threads."""
    for t0, tn, l0, lc in header.cells():
        for variant, codec in enumerate(codecs):
            ranges = {layer: header.local_range(layer, t0, tn) for layer in range(l0, l0 + lc)}
            filled = [layer for layer, (lo, hi) in ranges.items() if hi > lo]
            pairs = [(kv.layers[l].keys[:, ranges[l][0]:ranges[l][1]], kv.layers[l].values[:, ranges[l][0]:ranges[l][1]])
                     for l in filled]
            ctxs = [layer_context(header, l, ranges[l], kv.device, backend, threads) for l in filled]
            if not filled:
                coded = {}
            elif codec.joint_sections:
                coded = {filled[0]: coding(threads, lambda: codec.encode_frame(pairs, ctxs))}
            else:
                coded = dict(zip(filled, coding(threads, lambda: codec.encode_layers(pairs, ctxs))))
            yield Frame(variant, t0, tn, l0, [coded.get(layer, b"") for layer in range(l0, l0 + lc)])


def output_bytes(header: Header, layers: Iterable[int], token_start: int, token_count: int) -> int:
    """Bytes of the tensors that decoding ``layers`` over a token range gives, as the header declares them."""
    item = getattr(torch, header.dtype).itemsize
    total = 0
    for layer in layers:
        lo, hi = header.local_range(layer, token_start, token_count)
        s = header.layers[layer]
        total += s.heads * (hi - lo) * (s.key_dim + s.value_dim) * item
    return total


def check_output(header: Header, layers: Iterable[int], token_start: int, token_count: int,
                 max_bytes: int | None) -> None:
    """Refuse a decode whose declared output exceeds the caller's ``max_bytes``, before anything is decoded."""
    check_limit(output_bytes(header, layers, token_start, token_count), max_bytes, "the decoded output")


@dataclass(frozen=True)
class DecodeRequest:
    """One decode's arguments, each checked once, in the step that has what it is checked against.

    Every decode entry point (:func:`kvcodec.decode` of bytes, a path, a file or a stream, :meth:`Reader.decode`,
    :meth:`Reader.read_chunk`, :func:`iter_chunk_layers`) builds one in three steps: :meth:`make` checks the
    device and ``threads`` before anything is read, :meth:`bind` the ``backend`` against the container's codecs and
    the ``layers`` against its header, :meth:`select` the ``positions`` against the token range decoded and the
    declared output against ``max_bytes``.  The decode code below takes it and checks none of these again.
    """

    device: torch.device
    threads: int
    backend: str = "auto"
    layers: tuple[int, ...] | None = None  # as asked; None: every layer the selection holds
    positions: tuple[int, ...] | None = None
    max_bytes: int | None = None
    header: Header | None = None  # from bind
    codecs: tuple[Codec, ...] = ()
    token_range: tuple[int, int] = (0, 0)  # from select
    wanted: tuple[int, ...] = ()  # the layers decoded

    @classmethod
    def make(cls, *, device: torch.device | str | None = None, threads: int = DEFAULT_THREADS, backend: str = "auto",
             layers: Sequence[int] | None = None, positions: Sequence[int] | None = None,
             max_bytes: int | None = None) -> DecodeRequest:
        """The caller's arguments; a device this machine lacks or a bad ``threads`` is refused here.  ``max_bytes``
        is the container reader's, which checked it."""
        return cls(resolve_device(device), check_threads(threads), backend, None if layers is None else tuple(layers),
                   None if positions is None else tuple(positions), max_bytes)

    def bind(self, header: Header, codecs: Sequence[Codec]) -> DecodeRequest:
        """This request for the container of ``header``, whose variants ``codecs`` decode."""
        check_backend(codecs, self.backend)
        check_layers(header, self.layers)
        return replace(self, header=header, codecs=tuple(codecs))

    def select(self, token_start: int, token_end: int, held: Sequence[int]) -> DecodeRequest:
        """This request decoding tokens ``token_start..token_end`` of the layers asked for, else of the ``held``
        layers the chunks selected hold."""
        assert self.header is not None, "select a bound request"
        if self.positions is not None and len(self.positions) != token_end - token_start:
            raise InvalidInputError(f"{len(self.positions)} positions for the {token_end - token_start} tokens decoded "
                                    f"(tokens {token_start}..{token_end - 1})")
        wanted = tuple(held) if self.layers is None else self.layers
        check_output(self.header, set(wanted), token_start, token_end - token_start, self.max_bytes)
        return replace(self, token_range=(token_start, token_end), wanted=wanted)

    def context(self, layer: int, token_range: tuple[int, int]) -> LayerContext:
        """The context, threads included, in which a codec decodes ``layer``'s section covering ``token_range``."""
        assert self.header is not None
        return layer_context(self.header, layer, token_range, self.device, self.backend, self.threads)

    def moved(self, kv: KVCache, layers: Sequence[int]) -> KVCache:
        """``kv``, the decoded model ``layers``, with its keys moved to the request's positions (none asked: ``kv``
        itself).  The rule, for every entry point: ``positions`` has one id per token of the range, and a decoded
        layer holds the range's last tokens, so the cache takes the last of them.  The rotary setting is the
        container's codecs' (a kvtc container's calibration), else the one a codec has installed for the model."""
        if self.positions is None:
            return kv
        assert self.header is not None
        n, end = kv.num_tokens, self.token_range[1]
        meta = self.header.meta
        kv = KVCache(kv.layers, model=meta.get("model"), token_ids=kv.token_ids, rope=meta.get("rope"),
                     positions=header_positions(self.header)[end - n:end])
        rotary = next((r for c in self.codecs if (r := c.rotary()) is not None), None)
        if rotary is None:
            rotary = installed_rotary(kv.model)
        return reposition(kv, self.positions[len(self.positions) - n:], rotary, layers=layers)


def decode_sections(request: DecodeRequest, codec: Codec, token_start: int, token_count: int,
                    sections: dict[int, bytes], *, layer_start: int,
                    wanted: Sequence[int]) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
    """Decode a chunk's sections (by layer) together; returns (first local token, keys, values) by layer,
    leaving out layers that hold no tokens in the chunk.  A codec with joint sections decodes the ``wanted``
    layers from the one section it reads of the frame at ``layer_start``."""
    header = request.header
    assert header is not None
    if codec.joint_sections:
        return _decode_joint(request, codec, token_start, token_count, sections, layer_start, wanted)
    ctxs = {}
    for layer, data in sections.items():
        lo, hi = header.local_range(layer, token_start, token_count)
        if hi == lo:
            if data:
                raise CorruptDataError(f"layer {layer} holds no tokens in chunk at {token_start}, but its section is not empty")
            continue
        ctxs[layer] = request.context(layer, (lo, hi))
    if not ctxs:
        return {}
    decoded = _guarded(request, codec, token_start,
                       lambda: codec.decode_layers([sections[l] for l in ctxs], list(ctxs.values())))
    return _checked(codec, ctxs, dict(zip(ctxs, decoded)))


def _guarded(request: DecodeRequest, codec: Codec, token_start: int, fn: Callable[[], T]) -> T:
    try:
        return coding(request.threads, fn)
    except (KVCodecError, MemoryError):  # running out of memory is the machine's state, not the file's
        raise
    except Exception as e:  # a codec's own parsing failing on bad bytes is still bad bytes
        raise CorruptDataError(f"{codec.codec_id} could not decode the chunk at token {token_start}: {e}") from e


def _decode_joint(request: DecodeRequest, codec: Codec, token_start: int, token_count: int, sections: dict[int, bytes],
                  layer_start: int, wanted: Sequence[int]) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
    header = request.header
    assert header is not None
    filled = filled_layers(header, token_start, token_count, layer_start)
    if any(data for layer, data in sections.items() if not filled or layer != filled[0]):
        raise CorruptDataError(f"chunk at token {token_start}: a joint frame has data outside its first section")
    want = set(wanted) & set(filled)
    if not want:
        return {}
    if filled[0] not in sections:
        raise InvalidInputError(f"decoding the chunk at token {token_start} needs the section of layer {filled[0]}")
    ctxs = {l: request.context(l, header.local_range(l, token_start, token_count)) for l in filled}
    decoded = _guarded(request, codec, token_start,
                       lambda: codec.decode_frame(sections[filled[0]], list(ctxs.values()), want))
    if set(decoded) != want:
        raise CorruptDataError(f"{codec.codec_id} did not decode the layers asked for")
    return _checked(codec, {l: ctxs[l] for l in sorted(want)}, decoded)


def _checked(codec: Codec, ctxs: dict[int, LayerContext], decoded: dict[int, tuple[torch.Tensor, torch.Tensor]]
             ) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
    """Decoded sections with their shapes checked, as (first local token, keys, values) by layer."""
    out = {}
    for layer, ctx in ctxs.items():
        keys, values = decoded[layer]
        s = ctx.shape
        if keys.shape != (s.heads, s.tokens, s.key_dim) or values.shape != (s.heads, s.tokens, s.value_dim):
            raise CorruptDataError(f"{codec.codec_id} decoded layer {layer} to the wrong shape")
        out[layer] = (ctx.token_start, keys, values)
    return out


class Assembler:
    """Collects decoded sections and builds the KVCache they cover."""

    def __init__(self, header: Header, layers: Sequence[int], token_start: int, token_end: int) -> None:
        self.header, self.layers = header, list(layers)
        self.token_start, self.token_end = token_start, token_end
        self.parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {l: [] for l in self.layers}

    def add(self, layer: int, decoded: tuple[int, torch.Tensor, torch.Tensor]) -> None:
        if layer in self.parts:
            self.parts[layer].append(decoded)

    def build(self, device: torch.device) -> KVCache:
        dtype = getattr(torch, self.header.dtype)
        out = []
        for layer in self.layers:
            s = self.header.layers[layer]
            lo, hi = self.header.local_range(layer, self.token_start, self.token_end - self.token_start)
            parts = sorted(self.parts[layer], key=lambda p: p[0])
            pos = lo
            for start, k, _ in parts:
                if start != pos:
                    raise CorruptDataError(f"layer {layer}: tokens {pos}..{start} are missing")
                pos += k.shape[1]
            if pos != hi:
                raise CorruptDataError(f"layer {layer}: tokens {pos}..{hi} are missing")
            if not parts:
                empty = dict(dtype=dtype, device=device)
                out.append((torch.empty(s.heads, 0, s.key_dim, **empty), torch.empty(s.heads, 0, s.value_dim, **empty)))
            elif len(parts) == 1:
                out.append(parts[0][1:])
            else:
                out.append((torch.cat([p[1] for p in parts], 1), torch.cat([p[2] for p in parts], 1)))
        kv = KVCache(out)
        # token_ids and positions describe the longest layer; the selection keeps the last tokens of the range
        meta = {k: self.header.meta[k] for k in ("model", "rope", "token_ids", "positions") if k in self.header.meta}
        for key in ("token_ids", "positions"):
            if key in meta:
                seq = meta[key][self.token_start:self.token_end]
                meta[key] = seq[len(seq) - kv.num_tokens:]
        return KVCache(kv.layers, **meta)


def check_layers(header: Header, layers: Sequence[int] | None) -> None:
    """Reject a layer selection that is empty or names layers the container does not have."""
    if layers is None:
        return
    n = len(header.layers)
    if not list(layers):
        raise InvalidInputError("no layers selected")
    bad = [l for l in layers if not (isinstance(l, int) and 0 <= l < n)]
    if bad:
        raise InvalidInputError(f"layer{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} "
                                f"{'do' if len(bad) > 1 else 'does'} not exist: the container has {n} layers (0-{n - 1})")


def decode_all(request: DecodeRequest, frames: Iterable[tuple[int, int, int, int, dict[int, bytes]]]) -> KVCache:
    """Decode ``(variant, token_start, token_count, layer_start, sections by layer)`` into the KVCache of the
    ``request``'s layers and token range, its keys moved to the request's positions."""
    assert request.header is not None
    asm = Assembler(request.header, request.wanted, *request.token_range)
    for variant, t0, tn, l0, sections in frames:
        codec = request.codecs[variant]
        own = sections if codec.joint_sections else {layer: data for layer, data in sections.items() if layer in asm.parts}
        for layer, decoded in decode_sections(request, codec, t0, tn, own, layer_start=l0,
                                              wanted=request.wanted).items():
            asm.add(layer, decoded)
    try:
        kv = asm.build(request.device)
    except InvalidInputError as e:
        raise CorruptDataError(f"decoded cache is inconsistent: {e}") from None
    return request.moved(kv, request.wanted)
