"""Loading a stored prefix into an engine's memory: the one load path every engine hook uses.

A :class:`PrefixLoad` streams a prompt's chunks out of a :class:`~kvcodec.store.KVStore`.  A fetch thread reads
chunk ``i+1`` from its tier (checked once: authentication, checksums, key, shape; :meth:`KVStore.read_chunk`)
while a decode thread decodes chunk ``i`` layer by layer into a *sink*: :class:`PagedSink` writes straight into an
engine's paged memory through :meth:`Codec.decode_layer_paged` (the codec's fused path: cachegen's Triton kernel,
kvfetcher's frame-wise restore), :class:`DenseSink` keeps tensors for a hook that wants them.  At most
``prefetch_bytes`` of fetched chunks wait for the decoder, which bounds the memory a load holds.

With several stored variants, a value large enough is read in pieces from a tier that can (``get_range``): when
the pieces show the link has slowed so far that the rest of it would arrive well after all of another variant, the
load abandons it for that variant (the rule of a video player abandoning a segment download).

Layer ``l`` is *ready* (:meth:`PrefixLoad.wait_layer`) once every chunk's layer ``l`` is in: chunks are decoded
in order and each chunk layer by layer, so an engine runs its first layers while the last chunk's later layers are
still decoding.  Only tokens ``start .. end-1`` are written: a chunk reaching outside them (the engine already
holds the tokens before ``start``, in blocks other requests may share) is decoded densely and only its part
inside is written.

The first chunk that is missing or fails ends the load: tokens from its first one on are the engine's to
recompute (:attr:`LoadResult.loaded_end`), and a chunk that is itself bad (corrupt, forged, of another shape) is
evicted (:meth:`KVStore.discard`).  Every chunk's outcome, tier, bytes and times are in
:attr:`LoadResult.chunks`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from kvcodec.cache import KVCache
from kvcodec.chunking import DecodeRequest, coding, decode_sections
from kvcodec.devices import resolve_device
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.layouts.paged import PagedLayout, paged_layout, slot_mapping, write_paged
from kvcodec.store.chunks import ChunkShape, FetchedChunk
from kvcodec.store.plan import DecodeBacklog, LoadPlanner, Option

if TYPE_CHECKING:
    from kvcodec.store.store import KVStore

log = logging.getLogger(__name__)

# Fetched chunks waiting for the decoder hold at most this many bytes (always at least one chunk): small variants
# run far ahead while the link is fast (a link that drops later then finds them already in), large ones a few.
DEFAULT_PREFETCH_BYTES = 64 << 20
# A large value is read in pieces of about PIECE_S seconds at the link's estimated speed (within PIECE_BYTES), so
# that a load notices a link that slowed within one piece (0.2 s when 1 Gbit/s falls to 20 Mbit/s), while a
# request's round trip (about 0.1 ms here) stays a few percent of a piece.  It abandons the value for a smaller
# variant of the chunk when the rest of it would arrive ABANDON_RATIO times later than all of that variant.
PIECE_S = 0.004
PIECE_BYTES = (256 << 10, 8 << 20)
ABANDON_RATIO = 1.5


@dataclass
class ChunkOutcome:
    """What happened to one chunk of a load: ``status`` is ``loaded``, ``missing`` (no tier holds it intact),
    ``failed`` (it did not decode or write; ``error`` says why), ``recompute`` (the planner left it and the rest
    to the engine) or ``skipped`` (an earlier chunk ended the load).  ``keys``: its key in each of the store's
    variants; ``variant``: the one fetched."""

    keys: list[str]
    start: int
    end: int
    status: str = "skipped"
    variant: int = -1
    tier: str | None = None
    nbytes: int = 0

    @property
    def key(self) -> str:
        return self.keys[self.variant]
    fetch_s: float = 0.0
    decode_s: float = 0.0
    error: str | None = None


@dataclass
class LoadResult:
    """A finished load of tokens ``start .. end-1``: those before ``loaded_end`` are in the sink, correctly.
    ``seconds`` from start to the last write; ``layer_ready_s``: when each layer held every token."""

    start: int
    end: int
    loaded_end: int
    chunks: list[ChunkOutcome] = field(default_factory=list)
    seconds: float = 0.0
    layer_ready_s: list[float] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.loaded_end >= self.end

    @property
    def nbytes(self) -> int:
        """Bytes read from the tiers (checked chunks only)."""
        return sum(c.nbytes for c in self.chunks)


class DenseSink:
    """Keeps each layer's loaded keys and values as ``[H, T, D]`` tensors on ``device``, in ``dtype`` (None: the
    chunks' own)."""

    def __init__(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self.device, self.dtype = resolve_device(device), dtype
        self._parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.rope: str | None = None

    def write(self, layer: int, token_start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.dtype is not None:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        self._parts.setdefault(layer, []).append((keys.to(self.device), values.to(self.device)))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values over every token written so far."""
        parts = self._parts.get(i)
        if not parts:
            raise InvalidInputError(f"layer {i} holds nothing")
        if len(parts) > 1:
            parts[:] = [(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1))]
        return parts[0]

    def cache(self, **meta: Any) -> KVCache:
        """Every layer written, as one cache (``meta`` as for :class:`KVCache`)."""
        return KVCache([self.layer(i) for i in range(len(self._parts))], rope=self.rope, **meta)


class PagedSink:
    """An engine's paged KV memory: one tensor per model layer in ``layout``, and the request's block table
    (``block_ids``, ``block_size`` tokens each).  Chunks decode straight into it."""

    def __init__(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], block_size: int,
                 layout: PagedLayout | str) -> None:
        self.layers, self.block_size, self.layout = list(layers), int(block_size), paged_layout(layout)
        device = self.layers[0].device if self.layers else torch.device("cpu")
        self.block_table = torch.tensor([int(b) for b in block_ids], dtype=torch.long, device=device)

    def slots(self, token_start: int, count: int) -> torch.Tensor:
        return slot_mapping(self.block_table, token_start, count, self.block_size)

    def write(self, layer: int, token_start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        paged = self.layers[layer]
        write_paged(paged, keys.to(paged.device), values.to(paged.device), self.slots(token_start, keys.shape[1]),
                    self.layout)

    def decode_into(self, chunk: FetchedChunk, layer: int, request: DecodeRequest) -> None:
        """Decode ``layer`` of a chunk lying wholly inside the load straight into the memory.  A fused decode and
        write cannot tell a fault of its bytes from one of the memory, so only a kvcodec error (corrupt bytes) blames
        the chunk: the bytes passed their checksums, and evicting good KV for a local fault would be worse."""
        codec, tokens = chunk.codec, chunk.end - chunk.start
        assert codec is not None
        ctx = request.context(layer, (0, tokens))
        coding(request.threads, lambda: codec.decode_layer_paged(
            chunk.sections[layer], ctx, self.layers[layer], self.slots(chunk.start, tokens), self.layout))


    def decode_frame_into(self, chunk: FetchedChunk, request: DecodeRequest) -> None:
        """Decode every layer of a chunk of a joint codec (one section for the frame) lying wholly inside the load
        straight into the memory."""
        codec, tokens = chunk.codec, chunk.end - chunk.start
        assert codec is not None and chunk.header is not None
        layers = range(len(chunk.header.layers))
        ctxs = [request.context(l, (0, tokens)) for l in layers]
        slots = self.slots(chunk.start, tokens)
        coding(request.threads, lambda: codec.decode_frame_paged(
            chunk.sections[0], ctxs, {l: self.layers[l] for l in layers}, {l: slots for l in layers}, self.layout))


def decode_chunk_into(store: KVStore, chunk: FetchedChunk, sink: DenseSink | PagedSink, start: int, end: int, *,
                      device: torch.device | str | None = None,
                      on_layer: Callable[[int], None] = lambda layer: None) -> None:
    """Decode a checked chunk's tokens ``start .. end-1`` into ``sink``, layer by layer (a codec coding a chunk's
    layers jointly decodes them at once), calling ``on_layer(l)`` after each layer is in.  A dense decode runs on
    ``device``, by default a paged sink's own."""
    header, codec, tokens = chunk.header, chunk.codec, chunk.end - chunk.start
    assert header is not None and codec is not None, "decode a chunk the store checked"
    if device is None and isinstance(sink, PagedSink) and sink.layers:
        device = sink.layers[0].device
    layers = range(len(header.layers))
    request = DecodeRequest.make(device=device, max_bytes=store.max_bytes(tokens)).bind(header, [codec]) \
        .select(0, tokens, layers)
    lo, hi = max(start, chunk.start) - chunk.start, min(end, chunk.end) - chunk.start
    if isinstance(sink, DenseSink):
        sink.rope = header.meta.get("rope")
    fused = isinstance(sink, PagedSink) and (lo, hi) == (0, tokens)
    if fused and codec.joint_sections:
        sink.decode_frame_into(chunk, request)  # type: ignore[union-attr]
        for l in layers:
            on_layer(l)
        return

    def dense(wanted: Sequence[int]) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
        return decode_sections(request, codec, 0, tokens, chunk.sections if codec.joint_sections else
                               {l: chunk.sections[l] for l in wanted}, layer_start=0, wanted=wanted)

    decoded = dense(layers) if codec.joint_sections else {}
    for l in layers:
        if fused:
            sink.decode_into(chunk, l, request)  # type: ignore[union-attr]
        else:
            _, k, v = decoded.pop(l) if decoded else dense([l])[l]
            sink.write(l, chunk.start + lo, k[:, lo:hi], v[:, lo:hi])
        on_layer(l)


class PrefixLoad:
    """Load tokens ``start .. end-1`` (default: all) of ``token_ids``'s stored prefix from ``store`` into ``sink``.

    :meth:`start` starts the fetch and decode threads and returns at once; :meth:`wait_layer` waits for one
    layer; :meth:`finish` waits for the whole load and says how far it got.  ``salt`` as for
    :meth:`KVStore.keys_for`; ``device`` is where a dense decode runs (default: a paged sink's memory's, else the
    CPU).
    """

    def __init__(self, store: KVStore, token_ids: Sequence[int], sink: DenseSink | PagedSink, *, start: int = 0,
                 end: int | None = None, salt: str | bytes | None = None, device: torch.device | str | None = None,
                 prefetch_bytes: int = DEFAULT_PREFETCH_BYTES, planner: LoadPlanner | None = None) -> None:
        token_ids = [int(t) for t in token_ids]
        self.store, self.sink, self.device = store, sink, device
        self.start_token = int(start)
        self.end = len(token_ids) if end is None else min(int(end), len(token_ids))
        if not 0 <= self.start_token <= self.end:
            raise InvalidInputError(f"cannot load tokens {start}..{end} of a {len(token_ids)}-token prompt")
        self.planner = planner or LoadPlanner(store)
        self.variants = self.planner.variants
        self.chunks = [ChunkOutcome(keys, s, e) for s, e, keys in store.variant_keys(token_ids, salt=salt)
                       if e > self.start_token and s < self.end]
        self.loaded_end = self.start_token
        self._queue: deque[tuple[int, FetchedChunk] | None] = deque()
        self._queued_bytes, self._prefetch_bytes = 0, int(prefetch_bytes)
        self._backlog = DecodeBacklog()
        self._cond = threading.Condition()
        self._ready_layers = 0  # layers whose every chunk is in
        self._finished = False
        self._stop = threading.Event()
        self._t0 = 0.0
        self._seconds = 0.0
        self._threads = [threading.Thread(target=self._fetch, name="kvcodec-fetch", daemon=True),
                         threading.Thread(target=self._decode, name="kvcodec-decode", daemon=True)]
        self._started = False
        self._shape: Any = None  # the first chunk's, which the others must match
        self.layer_ready_s: list[float] = []  # when each layer held every token, from start()

    # -- running ------------------------------------------------------------------------------------
    def start(self) -> PrefixLoad:
        if not self._started:
            self._started = True
            self._t0 = time.perf_counter()
            self.store.fetch_side_data()
            for t in self._threads:
                t.start()
        return self

    def _put(self, item: tuple[int, FetchedChunk] | None) -> bool:
        nbytes = 0 if item is None else len(item[1].data)
        with self._cond:
            while self._queue and self._queued_bytes + nbytes > self._prefetch_bytes and not self._stop.is_set():
                self._cond.wait(0.05)
            if self._stop.is_set():
                return False
            self._queue.append(item)
            self._queued_bytes += nbytes
            self._cond.notify_all()
        return True

    def _fetch(self) -> None:
        try:
            n = len(self.variants)
            adaptive = n > 1
            held = self.store.variant_sizes([k for c in self.chunks for k in c.keys]) if adaptive else []
            for i, outcome in enumerate(self.chunks):
                if self._stop.is_set():
                    return
                if adaptive:
                    options = [Option(v, *held[i * n + v]) for v in range(n) if held[i * n + v] is not None]
                    pick = self.planner.choose(options, outcome.end - outcome.start, self.end - outcome.start,
                                               self._backlog.seconds(before=i))
                    if pick is None:
                        outcome.status = "recompute" if options else "missing"
                        break
                    self._planned(i, pick)
                t0 = time.perf_counter()
                if adaptive:
                    chunk = self._read_or_switch(i, pick, options)
                else:
                    chunk = self.store.read_chunk(outcome.key, outcome.start, outcome.end)
                outcome.fetch_s = time.perf_counter() - t0
                if chunk is None:
                    outcome.status = "missing"
                    break
                outcome.tier, outcome.nbytes = chunk.tier, len(chunk.data)
                if not self._put((i, chunk)):
                    return
        except BaseException:  # noqa: BLE001 - the load ends here; the engine recomputes the rest
            log.warning("fetching a stored prefix failed", exc_info=True)
        self._put(None)

    def _read_or_switch(self, i: int, pick: Option, options: list[Option]) -> FetchedChunk | None:
        """Read the chosen variant, in pieces where its tier can (a video player's abandonment rule): when the
        pieces show that the rest of it would now arrive later than all of another variant, abandon it and read
        that one instead."""
        outcome = self.chunks[i]
        store, tokens, remaining = self.store, outcome.end - outcome.start, self.end - outcome.start
        tier = store.tier(pick.tier)
        piece_bytes = int(min(max(store.links[tier.name].estimate * PIECE_S, PIECE_BYTES[0]), PIECE_BYTES[1]))
        if not tier.ranged_reads or pick.nbytes < 2 * piece_bytes:
            return store.read_chunk(outcome.key, outcome.start, outcome.end)
        parts: list[bytes] = []
        got = 0
        while got < pick.nbytes:
            t0 = time.perf_counter()
            piece = store.call_tier(tier, "get_range", outcome.key, got, piece_bytes)
            seconds = time.perf_counter() - t0
            if not piece:
                return store.read_chunk(outcome.key, outcome.start, outcome.end)  # gone here: any tier holding it
            store.links[tier.name].observe(len(piece), seconds)
            parts.append(piece)
            got += len(piece)
            left_s = (pick.nbytes - got) * seconds / len(piece)
            others = [o for o in options if o.variant != pick.variant]
            backlog = self._backlog.seconds(before=i)
            switch = self.planner.choose(others, tokens, remaining, backlog) if others and got < pick.nbytes else None
            if switch is not None and self.planner.done_s(pick, tokens, backlog, fetch_s=left_s) > \
                    ABANDON_RATIO * self.planner.done_s(switch, tokens, backlog):
                log.info("abandoning variant %d of chunk %s after %d of %d bytes: the link slowed to %.1f MB/s",
                         pick.variant, outcome.key, got, pick.nbytes, len(piece) / seconds / 1e6)
                self._planned(i, switch)
                return self._read_or_switch(i, switch, others)
        chunk = store.accept(outcome.key, tier.name, b"".join(parts), outcome.start, outcome.end, evict=False)
        return chunk if chunk is not None else store.read_chunk(outcome.key, outcome.start, outcome.end)

    def _planned(self, i: int, pick: Option) -> None:
        self.chunks[i].variant = pick.variant
        self._backlog.add(i, self.planner.stage_s(pick, self.chunks[i].end - self.chunks[i].start)[1])

    def _decode(self) -> None:
        last = len(self.chunks) - 1
        try:
            while (item := self._next()) is not None:
                i, chunk = item
                outcome = self.chunks[i]
                on_layer = self._layer_ready if i == last else (lambda layer: None)
                t0 = time.perf_counter()
                self._backlog.begin(i)
                try:
                    self._check_shape(chunk)
                    decode_chunk_into(self.store, chunk, self.sink, self.start_token, self.end, device=self.device,
                                      on_layer=on_layer)
                except Exception as err:
                    outcome.status, outcome.error = "failed", f"{type(err).__name__}: {err}"
                    log.warning("stored chunk %s (tokens %d-%d) did not load: %s", chunk.key, chunk.start,
                                chunk.end - 1, outcome.error)
                    self.store.discard(chunk, err)
                    break
                finally:
                    outcome.decode_s = time.perf_counter() - t0
                    self._backlog.done(i)
                outcome.status = "loaded"
                self.store.decode_rate(self.variants[outcome.variant]).observe(chunk.end - chunk.start,
                                                                              outcome.decode_s)
                self.loaded_end = min(chunk.end, self.end)
        except BaseException:  # noqa: BLE001
            log.warning("loading a stored prefix failed", exc_info=True)
        finally:
            self._stop.set()
            self._seconds = time.perf_counter() - self._t0
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _next(self) -> tuple[int, FetchedChunk] | None:
        with self._cond:
            while not self._queue and not self._stop.is_set():
                self._cond.wait(0.05)
            if self._stop.is_set():
                return None
            item = self._queue.popleft()
            self._queued_bytes -= 0 if item is None else len(item[1].data)
            self._cond.notify_all()
            return item

    def _check_shape(self, chunk: FetchedChunk) -> None:
        """Without an engine shape the store checked against, every chunk must match the first one's."""
        assert chunk.header is not None
        shape = ChunkShape.of_header(chunk.header)
        if self._shape is None:
            self._shape = shape
        elif shape != self._shape:
            raise CorruptDataError(f"{chunk.key} holds layers of {shape}, the chunks before it {self._shape}")

    def _layer_ready(self, layer: int) -> None:
        with self._cond:
            self._ready_layers = layer + 1
            self.layer_ready_s.append(time.perf_counter() - self._t0)
            self._cond.notify_all()

    # -- waiting ------------------------------------------------------------------------------------
    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until layer ``layer`` holds every token of the load, or the load ended short of it; True when the
        layer holds every token.  Raises :class:`TimeoutError` after ``timeout`` seconds."""
        self.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished or self._ready_layers > layer, timeout):
                raise TimeoutError(f"layer {layer} did not load within {timeout} s")
            return self.loaded_end >= self.end if self._finished else True

    def finish(self) -> LoadResult:
        """Wait for the whole load; what it loaded, chunk by chunk."""
        self.start()
        for t in self._threads:
            t.join()
        return LoadResult(self.start_token, self.end, self.loaded_end, list(self.chunks), self._seconds,
                          list(self.layer_ready_s))

    def cancel(self) -> None:
        """Stop fetching and decoding after the chunk in hand (what is loaded stays loaded)."""
        self._stop.set()
