"""Loading a stored prefix into an engine's memory: the one load path every engine hook uses.

A :class:`PrefixLoad` (built by :meth:`kvcodec.store.KVStore.prefix_load`) streams a prompt's chunks out of a
store's :class:`~kvcodec.store.source.ChunkSource`.  A fetch thread reads chunks from their tiers (each checked
once: authentication, checksums, key, shape; :meth:`ChunkSource.read`) while a decode thread decodes the ones
already in, layer by layer, into a *sink* (:mod:`kvcodec.layouts.sinks`): into a :class:`PagedSink`, an engine's
paged memory, through :meth:`Codec.decode_layer_paged` (the codec's fused path: cachegen's Triton kernel,
kvfetcher's frame-wise restore); into a :class:`DenseSink`, tensors for a hook that wants them.  At most ``prefetch_bytes`` of fetched chunks wait for the decoder, which bounds the memory a load holds.

With one stored variant, chunks are fetched and decoded in order; where the engine's prefill speed is known and the
tier reads ranges, each value in pieces, given up between two pieces once its rest, at the link's speed as the last
piece measured it, and its decode would end later than the engine computing the chunk (the engine then recomputes
from that chunk).  Before, such a load read its chunk whole on the estimate it started with: a fresh raw engine
inside vLLM at 20 Mbit/s spent 4.7 s on one 256-token chunk before it handed the prompt over (13.1 s to its first
token, against 8.6 s recomputing).  With several, the load works from both ends
(:mod:`kvcodec.store.plan`): the largest variant of the chunks from the front, which decode at once, while the
decoder works back from the last chunk through the smallest variant, which is dear to decode and cheap on the link.
Three rules keep both stages busy without a byte or a decode spent where it does not pay (issue 33):

- The decoder starts a small variant's decode only where the whole load then ends sooner than with the large
  variants the fetch is bringing, those that would arrive during the decode and wait behind it counted
  (:meth:`PrefixLoad._large_sooner`); otherwise it stays free for them, so on a fast link a cheap-to-restore chunk
  is written as it arrives, never behind a slow decode; and none before the link was timed
  (:meth:`PrefixLoad._link_timed`, ``UNTIMED_WAIT_S``).  (Before: the load read every chunk's small variant first,
  and the decoder, with nothing else in, started on the last one; at 10 Gbit/s the raw chunks waited behind a
  cachegen decode (about 50 ms a 64-token chunk): 2.59x raw's load time in ``bench/adaptive_inprocess.py``, now
  0.92x.)
- The fetch reads a chunk's small variant, from the back, only once the decoder could need it: once it could be
  through the small variants it holds and this one before the large one arrives were the link ``INSURANCE`` times
  slower than estimated (:meth:`PrefixLoad._small_needed`, checked again between every two pieces of a large read,
  so a link that drops makes them needed within one piece), and what it holds would last less than ``DUE_AHEAD``
  such reads: on a slow link each small read measures the link, so a rise shows in the next one.  A small variant
  that costs at most ``CHEAP_SHARE`` of the large one's bytes is read even so, as insurance against a drop.
  Before, every small variant was read as insurance: 16-19% of the bytes used were wasted at 100 Mbit/s and faster
  (cachegen: a sixth of raw's bytes); now 0-2.4% (the same bench).  The price: after a drop, a dear small variant
  still needed comes over the slower link.  A load whose link estimate is not this process's own and recent (``FRESH_S``) reads
  the last chunk's small variant first, to measure the link with a value it needs if the link is slow.
- A large value is read in pieces (``get_range``) and given up between two pieces once the decoder took that chunk's
  small variant (a video player's abandonment rule), or once its rest can no longer be in in time.  A large read
  starts only where it is in time on a link ``INSURANCE`` times slower than estimated.  Each piece measures the
  link: the estimate follows a rise at once and most of a drop within one piece
  (:data:`~kvcodec.store.telemetry.LINK_FOLLOW`), and the read's own last piece counts until another read measured
  the link.  A read given up while its chunk may still come large keeps its pieces, and a later read of that value
  goes on from them (a warm load inside vLLM on the drop trace gave up a first 256 KiB piece that looked slow and
  then read the same value from its start).  Once
  every small variant is in, the fetch keeps a probe under way: the lowest chunk's large variant in ``PROBE_BYTES``
  pieces, within a budget of ``PROBE_SHARE`` of the small variants' bytes spread over the decodes still queued, so
  that a link that rises is seen within one piece and the rest of that chunk comes large when it can be in in
  time.  (Before, a load that started on a slow link never read the link again once its small variants were in:
  on a rise from 20 Mbit/s to 10 Gbit/s 0.1 s in, 1.71x raw's load time; now 1.02x.  A probe without a budget
  wasted 61-225% of the bytes used at 20 Mbit/s inside vLLM; with it, 2-5% over the same link in
  ``tests/test_shaped_link_adaptation.py``'s setup.)

Layer ``l`` is *ready* (:meth:`PrefixLoad.wait_layer`) once every chunk's layer ``l`` is in: each chunk is decoded
layer by layer, so an engine runs its first layers while the last chunk's later layers are still decoding.  Only
tokens ``start .. end-1`` are written: a chunk reaching outside them (the engine already holds the tokens before
``start``, in blocks other requests may share) is decoded densely and only its part inside is written.

A chunk that is missing or fails ends the load there: tokens from its first one on are the engine's to recompute
(:attr:`LoadResult.loaded_end`), and a chunk that is itself bad (corrupt, forged, of another shape) is evicted
(:meth:`ChunkSource.discard`).  Every chunk's outcome, tier, times and the planner's :class:`Decision` are in
:attr:`LoadResult.chunks`, and every byte a tier served for it once: as used (the value decoded into the sink) or
as wasted (read and not used: the small variant of a chunk that came large, a large read given up, a bad copy, a
chunk read past where the load ended).  Each decision is logged at DEBUG.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvcodec.chunking import DecodeRequest, coding, decode_sections
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.layouts.sinks import DenseSink, PagedSink
from kvcodec.store.chunks import ChunkShape, FetchedChunk
from kvcodec.store.plan import (BUDGET_FULL, LARGE_IN_TIME, LARGE_NOT_COMING, LARGE_PROBED, LARGE_TOO_LATE,
                                ONE_VARIANT, RECOMPUTE, SMALL_PAYS, SMALL_UNMEASURED, Decision, LoadPlanner, Option)
from kvcodec.store.source import ChunkSource
from kvcodec.store.telemetry import LINK_FOLLOW, ROUND_TRIP_S, Link

log = logging.getLogger(__name__)

# Fetched chunks waiting for the decoder hold at most this many bytes (always at least one chunk): the small
# variants of a long prompt all fit (kvtc: about 0.2 MB per 1000 tokens of SmolLM2), and a few large ones.
DEFAULT_PREFETCH_BYTES = 64 << 20
# A large value is read in pieces of about PIECE_S seconds at the link's estimated speed (within PIECE_BYTES; a
# load's first piece the least, to measure the link before committing to more), so that a load gives it up within
# one piece of the decoder reaching its chunk, or of the link slowing (0.2 s when 1 Gbit/s falls to 20 Mbit/s),
# while a request's round trip (about 0.1 ms here) stays a few percent of a piece.
PIECE_S = 0.004
PIECE_BYTES = (256 << 10, 8 << 20)
# A probe of an idle link reads pieces this small, at most a PROBE_DUTY share of the time and at most PROBE_SHARE of
# the bytes of the load's small variants in all, spread over the decodes still queued: what it reads is wasted unless
# the link rises.  A duty cycle alone wasted 61-225% of the bytes used at 20 Mbit/s inside vLLM (2,048 tokens in
# 256-token kvtc chunks, 1.8 MB used): a shaper's token bucket (tbf's: 128 KiB) refills while the probe idles, so
# every probe piece rode it at the veth's speed, looked like a rise, and turned into a read by rule that was given up.
PROBE_BYTES = 32 << 10
PROBE_DUTY = 0.2
PROBE_SHARE = 0.05
# A probe piece that looks like a rise (LINK_FOLLOW times the estimate) may have ridden such a bucket: it moves the
# estimate only once a piece this large, read at once after it and paid from the same budget, confirms it.  Behind
# tbf's 128 KiB bucket, the 96 KiB the probe piece left make it look at most 2.5x faster, which the estimate averages
# rather than follows.  A load whose budget cannot pay for it sees a rise only through its other reads: at 5%, one
# with less than 3.8 MB of small variants (2,048 SmolLM2 tokens in kvtc: 1.8 MB).
CONFIRM_BYTES = 160 << 10
# Small variants are read for the chunks the decoder could reach before their large variants arrived on a link this
# many times slower than estimated: the margin for an estimate that is somewhat off (a decode beside the reads, a
# busy machine); a drop of more than LINK_FOLLOW times is seen within one piece and makes them needed then.  2 read a
# small variant too many in most mixed loads (8-12% of the bytes used wasted at 20 and 100 Mbit/s); 1.25, 0-2.4%.
# A large read starts (or a probe turns into one) only where it is in time on a link this much slower, too: inside
# vLLM at 100 Mbit/s, warm loads started the first chunk's raw read just in time by the estimate and gave it up
# after about 9 MB when the decodes ran faster than estimated.
INSURANCE = 1.25
# A needed small variant is read once what the decoder holds would last less than this many of its reads on that
# slower link: on a slow link the small variants come a read or two ahead of the decoder, not all at the start, and
# each read measures the link, so a rise shows in the next one.  Read all at once, a load inside vLLM whose link
# rose from 20 Mbit/s after its small variants were in had only a probe to see it, which a 5% budget cannot pay for
# behind a shaper's bucket: it loaded every chunk small (2.40 s; raw alone 1.21 s).
DUE_AHEAD = 2.0
# A small variant that costs at most this share of its chunk's large one is read even where the large one will be in
# in time, as insurance against a drop: inside vLLM, on a link falling from 1 Gbit/s to 20 Mbit/s 0.3 s in, loads
# that had read no kvtc value (2% of raw's bytes) fetched them over the slow link after it and came 5-14% later
# than kvtc alone.
CHEAP_SHARE = 0.05
# An estimate of a link that no read of this process measured within this many seconds (a fresh engine's, restored
# from its predecessor's) is checked first with the last chunk's small variant: a fresh engine whose predecessor saw
# a fast link started a raw read at 20 Mbit/s and gave up its first 256 KiB piece (18% of the bytes it used).
FRESH_S = 10.0
# Until a read of a round trip or longer timed the link within FRESH_S (a small value on a slow link, or a large value
# read whole in pieces), or the load has read this long, the decoder starts no small decode by the estimates: a fresh
# engine plans on its predecessor's estimate or the prior, and a small value's read, mostly its round trip, cannot
# show a fast link.  Inside vLLM on an unshaped link a fresh engine's first load took the last chunk's kvtc at once,
# on the 1 Gbit/s prior, while the link gave 0.6-1 GB/s: the decode (0.5 s on a cold engine) slowed the raw reads
# beside it 5-14x, and the load took 0.73-0.95 s against a warm one's 0.3 s.  Within this wait, short pieces that
# come faster than the estimate raise it; the first reads of a fresh engine are slow (cold), and 20 ms was not enough.
UNTIMED_WAIT_S = 0.2


@dataclass
class ChunkOutcome:
    """What happened to one chunk of a load: ``status`` is ``loaded``, ``missing`` (no tier holds it intact),
    ``failed`` (it did not decode or write; ``error`` says why), ``recompute`` (the planner left it and the rest
    to the engine) or ``skipped`` (an earlier chunk ended the load).  ``keys``: its key in each of the store's
    variants; ``variant``: the one loaded.  Of the bytes the tiers served for it, ``nbytes`` are the value decoded
    into the sink (0 unless loaded), ``wasted_bytes`` the rest.  ``decision``: why the planner chose as it did
    (None for a chunk it never reached)."""

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
    wasted_bytes: int = 0
    decision: Decision | None = None


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
        """Bytes read from the tiers and used: the values decoded into the sink."""
        return sum(c.nbytes for c in self.chunks)

    @property
    def wasted_bytes(self) -> int:
        """Bytes read from the tiers and not used (see :class:`ChunkOutcome`)."""
        return sum(c.wasted_bytes for c in self.chunks)


def _decode_paged_layer(sink: PagedSink, chunk: FetchedChunk, layer: int, request: DecodeRequest) -> None:
    """Decode ``layer`` of a chunk lying wholly inside the load straight into the memory.  A fused decode and write
    cannot tell a fault of its bytes from one of the memory, so only a kvcodec error (corrupt bytes) blames the
    chunk: the bytes passed their checksums, and evicting good KV for a local fault would be worse."""
    codec, tokens = chunk.codec, chunk.end - chunk.start
    assert codec is not None
    ctx = request.context(layer, (0, tokens))
    coding(request.threads, lambda: codec.decode_layer_paged(
        chunk.sections[layer], ctx, sink.layers[layer], sink.slots(chunk.start, tokens), sink.layout))


def _decode_paged_frame(sink: PagedSink, chunk: FetchedChunk, request: DecodeRequest) -> None:
    """Decode every layer of a chunk of a joint codec (one section for the frame) lying wholly inside the load
    straight into the memory."""
    codec, tokens = chunk.codec, chunk.end - chunk.start
    assert codec is not None and chunk.header is not None
    layers = range(len(chunk.header.layers))
    ctxs = [request.context(l, (0, tokens)) for l in layers]
    slots = sink.slots(chunk.start, tokens)
    coding(request.threads, lambda: codec.decode_frame_paged(
        chunk.sections[0], ctxs, {l: sink.layers[l] for l in layers}, {l: slots for l in layers}, sink.layout))


def decode_chunk_into(chunk: FetchedChunk, sink: DenseSink | PagedSink, start: int, end: int, *, max_bytes: int,
                      device: torch.device | str | None = None,
                      on_layer: Callable[[int], None] = lambda layer: None) -> None:
    """Decode a checked chunk's tokens ``start .. end-1`` into ``sink``, producing at most ``max_bytes``, layer by
    layer (a codec coding a chunk's layers jointly decodes them at once), calling ``on_layer(l)`` after each layer
    is in.  A dense decode runs on ``device``, by default a paged sink's own."""
    header, codec, tokens = chunk.header, chunk.codec, chunk.end - chunk.start
    assert header is not None and codec is not None, "decode a chunk the store checked"
    if device is None and isinstance(sink, PagedSink) and sink.layers:
        device = sink.layers[0].device
    layers = range(len(header.layers))
    request = DecodeRequest.make(device=device, max_bytes=max_bytes).bind(header, [codec]) \
        .select(0, tokens, layers)
    lo, hi = max(start, chunk.start) - chunk.start, min(end, chunk.end) - chunk.start
    if isinstance(sink, DenseSink):
        sink.rope = header.meta.get("rope")
    fused = isinstance(sink, PagedSink) and (lo, hi) == (0, tokens)
    if fused and codec.joint_sections:
        _decode_paged_frame(sink, chunk, request)  # type: ignore[arg-type]
        for l in layers:
            on_layer(l)
        return

    def dense(wanted: Sequence[int]) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
        return decode_sections(request, codec, 0, tokens, chunk.sections if codec.joint_sections else
                               {l: chunk.sections[l] for l in wanted}, layer_start=0, wanted=wanted)

    decoded = dense(layers) if codec.joint_sections else {}
    for l in layers:
        if fused:
            _decode_paged_layer(sink, chunk, l, request)  # type: ignore[arg-type]
        else:
            _, k, v = decoded.pop(l) if decoded else dense([l])[l]
            sink.write(l, chunk.start + lo, k[:, lo:hi], v[:, lo:hi])
        on_layer(l)


@dataclass
class _Reading:
    """The large variant the fetch thread is reading: which chunk, since when its current piece, that piece's
    bytes, the bytes after it and the throughput its last piece had."""

    chunk: int
    option: Option
    since: float
    piece: int
    after: int
    bps: float = math.inf  # the throughput of its last piece
    measured_at: float | None = None  # the link estimate's latest measurement then (that piece's)


class PrefixLoad:
    """Load tokens ``start .. end-1`` (default: all) of a prompt's stored prefix from ``source`` into ``sink``.

    ``chunks``: ``(start, end, keys)`` of every chunk of the prompt, its key in each of ``planner.variants``
    (:meth:`KVStore.prefix_load` builds a load).  :meth:`start` starts the fetch and decode threads and returns at
    once; :meth:`wait_layer` waits for one layer; :meth:`finish` waits for the whole load and says how far it got.
    ``device`` is where a dense decode runs (default: a paged sink's memory's, else the CPU).  Reads and decodes
    feed ``planner.telemetry``.
    """

    def __init__(self, source: ChunkSource, chunks: Sequence[tuple[int, int, list[str]]],
                 sink: DenseSink | PagedSink, *, planner: LoadPlanner, start: int = 0, end: int | None = None,
                 device: torch.device | str | None = None, prefetch_bytes: int = DEFAULT_PREFETCH_BYTES) -> None:
        total = chunks[-1][1] if chunks else 0
        self.source, self.sink, self.device = source, sink, device
        self.start_token = int(start)
        self.end = total if end is None else min(int(end), total)
        if not 0 <= self.start_token <= self.end:
            raise InvalidInputError(f"cannot load tokens {start}..{end} of a {total}-token prompt")
        self.planner, self.telemetry = planner, planner.telemetry
        self.variants = planner.variants
        self.chunks = [ChunkOutcome(list(keys), s, e) for s, e, keys in chunks
                       if e > self.start_token and s < self.end]
        self._cond = threading.Condition()
        # Fetched chunks not yet taken by the decoder.  Front: read in order by the fetch thread (with several
        # variants, the largest), decoded lowest first.  Back: the smallest variant of the chunks the decoder
        # could need, read and decoded from the highest down.  Together they hold at most ``prefetch_bytes``
        # (always at least one chunk).
        self._front: dict[int, FetchedChunk] = {}
        self._back: dict[int, FetchedChunk] = {}
        self._held_bytes, self._prefetch_bytes = 0, int(prefetch_bytes)
        self._options: dict[int, tuple[Option, Option | None]] = {}  # per chunk: its smallest and largest variant
        self._value_bytes: dict[tuple[int, str], int] = {}  # (chunk, key): the size of its value read whole
        self._upgrades: dict[int, Decision] = {}  # chunks whose large variant the fetch thread read, and why
        self._late_from = len(self.chunks)  # the fetch judges large variants from this chunk on too late, now
        self._taken: set[int] = set()  # chunks the decoder took
        self._limit = len(self.chunks)  # chunks from here on are the engine's (missing, recomputed or failed)
        self._layers_done = [0] * len(self.chunks)
        self._reading: _Reading | None = None
        self._resume: dict[int, list[bytes]] = {}  # pieces of a large value whose read was given up, by chunk
        self._link_checked = False  # a piece read before handing the load to the engine (_check_link)
        self._low = len(self.chunks)  # the small variants of the chunks from here on are read (or being read)
        self._front_next = 0  # the chunk whose large variant the fetch reads next (or is reading)
        self._pieces_read = 0  # pieces of large variants read so far (the first is the least, to measure the link)
        self._probe_left = 0  # bytes a probe may still read (PROBE_SHARE of the small variants')
        self._decoding: tuple[float, float] | None = None  # the decode under way: since when, its estimate
        self._decoding_small = False  # ... and whether it is a small variant's
        self._small_decodes = 0  # small variants' decodes started so far (a read beside one spans a single one)
        self._fetched_all = False
        self._full = False  # the fetch thread waits for room in the byte budget
        self._finished = False
        self._stop = threading.Event()
        self._t0 = 0.0
        self._reads_t0 = math.inf  # when the fetch thread began reading chunks
        self._seconds = 0.0
        self._threads = [threading.Thread(target=self._fetch, name="kvcodec-fetch", daemon=True),
                         threading.Thread(target=self._decode, name="kvcodec-decode", daemon=True)]
        self._started = False
        self._shape: Any = None  # the first chunk's, which the others must match
        self.layer_ready_s: list[float] = []  # when each layer held every token, from start()

    @property
    def loaded_end(self) -> int:
        """Tokens before this are in the sink: those of the loaded chunks before the first that is not."""
        end = self.start_token
        for c in self.chunks:
            if c.status != "loaded":
                break
            end = min(c.end, self.end)
        return end

    # -- running ------------------------------------------------------------------------------------
    def start(self) -> PrefixLoad:
        if not self._started:
            self._started = True
            self._t0 = time.perf_counter()
            self.source.fetch_side_data(self.variants)
            for t in self._threads:
                t.start()
        return self

    def _hold(self, i: int, chunk: FetchedChunk, front: bool) -> bool:
        """Keep a fetched chunk for the decoder once the byte budget allows; False when the load stopped or the
        decoder took the chunk meanwhile."""
        nbytes = len(chunk.data)
        with self._cond:
            while (self._front or self._back) and self._held_bytes + nbytes > self._prefetch_bytes \
                    and not self._stop.is_set() and i not in self._taken:
                self._full = True  # the decoder makes room: it takes small variants even where they do not pay
                self._cond.wait(0.05)
            self._full = False
            if self._stop.is_set() or i in self._taken:
                return False
            (self._front if front else self._back)[i] = chunk
            self._held_bytes += nbytes
            self._cond.notify_all()
        return True

    def _end_at(self, i: int, status: str) -> None:
        """Chunk ``i`` and those after it are the engine's."""
        with self._cond:
            if i < self._limit:
                self._limit = i
                self.chunks[i].status = status
            self._cond.notify_all()

    def _fetch(self) -> None:
        self._reads_t0 = time.perf_counter()  # (after the side data: a first load may fetch a calibration first)
        try:
            if len(self.variants) > 1:
                self._fetch_both_ends()
            else:
                self._fetch_in_order()
        except BaseException:  # noqa: BLE001 - the load ends here; the engine recomputes the rest
            log.warning("fetching a stored prefix failed", exc_info=True)
        with self._cond:
            self._fetched_all = True
            self._cond.notify_all()

    def _fetch_in_order(self) -> None:
        """One variant stored: its chunks from the front, while loading each and the rest ends sooner than the
        engine recomputing them (when the engine's prefill speed is known: one size question per tier first, and
        each value read in pieces where its tier reads ranges, given up partway once it would be later:
        :meth:`_read_unless_late`)."""
        sizes = None
        if self.planner.recompute_tps is not None:
            sizes = self.source.value_sizes([c.key for c in self.chunks], [c.end - c.start for c in self.chunks])
        for i, outcome in enumerate(self.chunks):
            if self._stop.is_set() or i >= self._limit:
                return
            if sizes is not None and sizes[i] is not None:
                option = Option(0, *sizes[i])
                worth = functools.partial(self.planner.worth_loading, option, None, outcome.end - outcome.start,
                                          self.end - outcome.start)
                if not self._loading_pays(i, option, outcome.key, worth):
                    self._decided(i, self.planner.decide(RECOMPUTE, None, (option,)))
                    self._end_at(i, "recompute")
                    return
                in_pieces = option if self.source.tier(option.tier).ranged_reads else None
            else:
                in_pieces = None
            if not self._read_into(i, outcome.key, front=True, until_late=in_pieces):
                return

    def _loading_pays(self, i: int, option: Option, key: str, worth: Callable[..., bool]) -> bool:
        """Whether loading chunk ``i`` and the rest ends sooner than the engine recomputing them, by ``worth``
        (called with ``free_link=`` True or False); where only the link's estimate says no, after
        :meth:`_check_link` has read a piece of ``option`` (chunk ``i``'s value under ``key``)."""
        return worth() or (worth(free_link=True) and self._check_link(i, option, key) and worth())

    def _check_link(self, i: int, option: Option, key: str) -> bool:
        """Once per load, before any other read of it: read a ``PROBE_BYTES`` piece of ``option`` (chunk ``i``'s
        value under ``key``) and, where it looks like a rise (a shaper's bucket makes a short read after an idle link
        look fast) or took too short a time to measure the link (a round trip's), a ``CONFIRM_BYTES`` piece at once,
        which moves the estimate.  Whether it read.  Without it a link that rose after a slow spell is never measured
        again, as every load recomputes: inside vLLM, after a request at 20 Mbit/s, the link back at 1 Gbit/s was
        still taken for 20 Mbit/s request after request.  The pieces are kept for a large read of the value to go on
        from."""
        with self._cond:
            if self._link_checked or any(c.nbytes or c.wasted_bytes for c in self.chunks):
                return False
            self._link_checked = True
        tokens = self.chunks[i].end - self.chunks[i].start
        estimate = self.telemetry.link(option.tier).throughput.estimate
        t0 = time.perf_counter()
        piece = self.source.read_range(option.tier, key, 0, min(PROBE_BYTES, option.nbytes), tokens, observe=False)
        seconds = time.perf_counter() - t0
        if not piece:
            return False
        parts = [piece]
        # a piece as short as a round trip says nothing of a link faster than it: inside vLLM over 1 Gbit/s a fresh
        # engine whose predecessor had measured 100 Mbit/s handed every raw load to vLLM on the 32 KiB piece alone
        # (bench/vllm_link.py: 9.2 s first request, 6.5 s warm, recompute's times); with this piece, 4.2 s and 1.7 s
        if (seconds < ROUND_TRIP_S or len(piece) > LINK_FOLLOW * estimate * seconds) and len(piece) < option.nbytes:
            more = self.source.read_range(option.tier, key, len(piece), CONFIRM_BYTES, tokens)
            parts += [more] if more else []
        else:
            self.source.observe(option.tier, len(piece), seconds)
        self._served(i, sum(map(len, parts)))
        if self.source.tier(option.tier).ranged_reads:  # (a read in pieces goes on from them)
            with self._cond:
                self._resume[i] = parts
        return True

    def _read_into(self, i: int, key: str, *, front: bool, until_late: Option | None = None) -> bool:
        """Read chunk ``i`` under ``key`` whole, or in pieces until it is late (``until_late``: its option, see
        :meth:`_read_unless_late`), and hold it; False (the load ends at ``i``) when no tier holds it intact, or it
        was given up."""
        outcome = self.chunks[i]
        t0 = time.perf_counter()
        chunk = self._read(i, key) if until_late is None else self._read_unless_late(i, until_late, key)
        outcome.fetch_s += time.perf_counter() - t0
        if chunk is None:
            if not self._stop.is_set():
                self._end_at(i, "missing")  # (a chunk given up has ended the load there already)
            return False
        return self._hold(i, chunk, front) or not self._stop.is_set()

    def _read_unless_late(self, i: int, option: Option, key: str) -> FetchedChunk | None:
        """Chunk ``i``'s one variant ``option`` under ``key``, read in pieces (going on from a link check's); None,
        the engine recomputing from ``i``, once between two pieces its rest at the link's speed (the estimate, or the
        last piece's where slower: the estimate may be a window of faster reads) and its decode would end later than
        the engine computing the chunk.  Chunks after it would cost a whole read each on the same link."""
        outcome, link = self.chunks[i], self.telemetry.link(option.tier)
        tokens, recompute_tps = outcome.end - outcome.start, self.planner.recompute_tps
        assert recompute_tps is not None  # (read so only where the engine's speed is known)
        with self._cond:
            parts = self._resume.pop(i, [])
        got, last, bps, read_s = sum(map(len, parts)), len(parts[-1]) if parts else 0, math.inf, 0.0
        while got < option.nbytes:
            if self._stop.is_set():
                return None
            rest_s = (option.nbytes - got) / min(link.throughput.estimate, bps) + self.planner.decode_s(option, tokens)
            if got and rest_s > tokens / recompute_tps:
                log.debug("chunk %d: given up after %d of its %d bytes: its rest %.3f s, recomputing it %.3f s", i,
                          got, option.nbytes, rest_s, tokens / recompute_tps)
                self._decided(i, self.planner.decide(RECOMPUTE, None, (option,)))
                self._end_at(i, "recompute")
                return None
            length = self._piece_bytes(link, last)
            if option.nbytes - got < 2 * length:
                length = option.nbytes - got
            piece, seconds = self._read_piece(i, option, key, got, length)
            if not piece:
                return self._read(i, key)  # gone here: any tier holding it
            parts.append(piece)
            got, last, read_s = got + len(piece), len(piece), read_s + seconds
            if seconds > 0 and link.measures(len(piece), seconds):
                bps = len(piece) / seconds
        chunk = self._pieces_checked(i, option, key, parts, read_s)
        return chunk if chunk is not None else self._read(i, key)

    def _read_piece(self, i: int, option: Option, key: str, offset: int, length: int, *,
                    observe: bool = True) -> tuple[bytes | None, float]:
        """At most ``length`` bytes from ``offset`` of chunk ``i``'s value ``option`` under ``key``, counted as served
        and as a piece read (None where its tier no longer holds it), and the seconds they took; ``observe``: see
        :meth:`ChunkSource.read_range`."""
        outcome = self.chunks[i]
        t0 = time.perf_counter()
        piece = self.source.read_range(option.tier, key, offset, length, outcome.end - outcome.start, observe=observe)
        seconds = time.perf_counter() - t0
        if piece:
            self._served(i, len(piece))
            self._pieces_read += 1
        return piece, seconds

    def _pieces_checked(self, i: int, option: Option, key: str, parts: list[bytes],
                        read_s: float) -> FetchedChunk | None:
        """Chunk ``i``'s value ``option`` under ``key``, read in ``parts`` over ``read_s`` seconds of reading, checked
        whole (not evicted where it fails: a concurrent rewrite can tear a value read in pieces); None where it
        fails."""
        outcome = self.chunks[i]
        self.telemetry.link(option.tier).read_whole(read_s)
        chunk = self.source.accept(key, option.tier, b"".join(parts), outcome.start, outcome.end, evict=False)
        if chunk is not None:
            self._value_bytes[i, key] = sum(map(len, parts))
        return chunk

    def _piece_bytes(self, link: Link, last: int) -> int:
        """The next piece of a value read in pieces by rule: a load's first ``PIECE_BYTES[0]`` (to measure the link
        before committing to more), then about ``PIECE_S`` at ``link``'s estimated speed within ``PIECE_BYTES``, at
        most twice the ``last`` piece of the value."""
        length = PIECE_BYTES[0] if not self._pieces_read else \
            int(min(max(link.throughput.estimate * PIECE_S, PIECE_BYTES[0]), PIECE_BYTES[1]))
        return min(length, 2 * last) if last else length

    def _read(self, i: int, key: str) -> FetchedChunk | None:
        """Chunk ``i`` under ``key`` from the fastest tier holding it intact (:meth:`ChunkSource.read`), every value
        read counted as served."""
        sizes: list[int] = []
        chunk = self.source.read(key, self.chunks[i].start, self.chunks[i].end,
                                 observe=lambda tier, nbytes, seconds: sizes.append(nbytes))
        self._served(i, sum(sizes))
        if chunk is not None:
            self._value_bytes[i, key] = sizes[-1]
        return chunk

    def _served(self, i: int, nbytes: int) -> None:
        """Tiers served ``nbytes`` for chunk ``i``: wasted until its decode uses them (:meth:`_used`)."""
        with self._cond:
            self.chunks[i].wasted_bytes += nbytes

    def _used(self, i: int, key: str) -> None:
        """Chunk ``i``'s value under ``key`` is in the sink: its bytes move from wasted to used."""
        with self._cond:
            outcome = self.chunks[i]
            outcome.nbytes = self._value_bytes[i, key]
            outcome.wasted_bytes -= outcome.nbytes

    def _fetch_both_ends(self) -> None:
        """The largest variant of the chunks from the front while each can be in before the decoder reaches it from
        the back; the smallest variant of the chunks from the back only as far as the decoder could need them; once
        every small variant is in, a probe of the lowest chunk's large one (see the module doc)."""
        n = len(self.variants)
        held = self.source.value_sizes([k for c in self.chunks for k in c.keys],
                                       [c.end - c.start for c in self.chunks for _ in c.keys])
        for i in range(len(self.chunks)):
            options = sorted((Option(v, *held[i * n + v]) for v in range(n) if held[i * n + v] is not None),
                             key=lambda o: o.nbytes)
            if not options:
                self._end_at(i, "missing")
                break
            self._options[i] = (options[0], options[-1] if len(options) > 1 else None)
        self._probe_left = int(PROBE_SHARE * sum(small.nbytes for small, _ in self._options.values()))
        self._measure_link_first()
        front = 0  # the lowest chunk not taken: the next whose large variant to read
        while not self._stop.is_set():
            with self._cond:
                self._low = min(self._low, self._limit)
                while front < self._limit and front in self._taken:
                    front += 1
                self._front_next = front
            if front >= self._limit:
                return
            large = self._weighed(front)[-1]  # (as the estimates are now: a link may have dropped)
            if not self._loading_pays(front, large, self.chunks[front].keys[large.variant],
                                      functools.partial(self._worth_loading, front)):
                self._decided(front, self.planner.decide(RECOMPUTE, None, self._weighed(front)))
                self._end_at(front, "recompute")
                return
            if front < self._low and self._read_small(front):
                continue
            large = self._options[front][1]
            rule = self._arrives_in_time(front, slower=INSURANCE) if large is not None else None
            with self._cond:
                self._late_from = len(self.chunks) if rule is not None else front
            if large is not None and (rule is not None or front >= self._low):
                if not self._read_large(front, rule):
                    return  # the large variant cannot be probed in pieces here, and every small one is in
                with self._cond:
                    given_up = front not in self._front and front not in self._taken
                if given_up and front < self._low:
                    continue  # given up before this chunk's small variant was in: that is still to read
            elif front < self._low:  # the large one will not be in time: the small ones down to here will be needed
                with self._cond:
                    self._cond.wait(PIECE_S)  # ... once due: the decoder moving on wakes this
                continue
            front += 1

    def _measure_link_first(self) -> None:
        """Where no read of this process measured the link within ``FRESH_S``, read the last chunk's small variant
        first: it measures the link with a value the load needs if the link is slow now, and costs one small value
        if it is fast."""
        last = len(self.chunks) - 1
        if last not in self._options or self._options[last][1] is None:
            return
        small, large = self._options[last]
        throughput = self.telemetry.link(large.tier).throughput
        measured_at = getattr(throughput, "measured_at", None)  # (a test's pinned estimate has none: it is fresh)
        if throughput.samples and (measured_at is None or time.time() - measured_at < FRESH_S):
            return
        self._low = last
        self._read_into(last, self.chunks[last].keys[small.variant], front=False)

    def _read_small(self, front: int) -> bool:
        """Read the small variant of the highest chunk (not below ``front``) whose small variant is not in, if the
        decoder could need it; whether it read one (or the load ended there)."""
        b = self._low - 1
        if not front <= b < self._limit or not self._small_needed(b):
            return False
        self._low = b
        self._read_into(b, self.chunks[b].keys[self._options[b][0].variant], front=False)
        return True

    def _small_needed(self, b: int) -> bool:
        """Whether the decoder, working back through the small variants it holds and then chunk ``b``'s, could be
        through ``b`` before ``b``'s large variant is in and decoded were the link ``INSURANCE`` times slower than
        estimated, and what it holds would last less than ``DUE_AHEAD`` reads of ``b``'s small variant on that link
        (always, where the small variant's decode was never measured: the first load finds out); or, where it could
        not, whether the small variant costs at most ``CHEAP_SHARE`` of the large one's bytes (insurance)."""
        small, large = self._options[b]
        if large is None or not self.planner.decode_known(small):
            return True
        tokens = self.chunks[b].end - self.chunks[b].start
        with self._cond:
            back_s = self._decodes_queued_s()
            large_s = self._large_eta_s(b, INSURANCE)
        fetch_s = self.planner.fetch_s(small)
        if back_s + fetch_s + self.planner.decode_s(small, tokens) >= large_s:
            return small.nbytes <= CHEAP_SHARE * large.nbytes  # insurance, where it is cheap
        return back_s < DUE_AHEAD * INSURANCE * fetch_s

    def _large_eta_s(self, j: int, slower: float = 1.0) -> float:
        """Seconds until chunk ``j``'s large variant is in and decoded, the fetch reading large variants in order
        from where it is, the reads not yet started on a link ``slower`` times slower than estimated; inf when none
        is coming for ``j`` (the fetch judged it too late).  Under ``_cond``."""
        if j >= self._late_from or self._options[j][1] is None:
            return math.inf
        large = self._options[j][1]
        assert large is not None
        first, fetch_s, lag = self._front_next, 0.0, 1.0
        reading = self._reading
        if reading is not None:
            # the read under way's last piece is the newest measure of the link: where it was slower than the
            # estimate (which a window of older reads may hold up), the rest comes at its speed
            throughput = self.telemetry.link(reading.option.tier).throughput
            if getattr(throughput, "measured_at", None) == reading.measured_at:  # no read measured the link since
                lag = max(1.0, throughput.estimate / reading.bps)
            piece_s = self.planner.fetch_s(reading.option, reading.piece) * lag
            elapsed = time.perf_counter() - reading.since
            if reading.piece and elapsed > piece_s:  # the piece under way is late: the link is at most this fast
                lag *= elapsed / piece_s
            fetch_s = max(0.0, piece_s - elapsed) + self.planner.fetch_s(reading.option, reading.after) * lag
            first = reading.chunk + 1 if reading.chunk < j else j + 1
        # reads not started yet may find the link ``slower``; the one under way has measured it
        fetch_s += slower * lag * sum(self.planner.fetch_s(self._options[k][1])  # type: ignore[arg-type]
                                      for k in range(first, j + 1) if k not in self._taken and k not in self._front
                                      and self._options[k][1] is not None)
        return fetch_s + self.planner.decode_s(large, self.chunks[j].end - self.chunks[j].start)

    def _worth_loading(self, i: int, *, free_link: bool = False) -> bool:
        """Whether loading chunk ``i`` and those after it ends sooner than the engine recomputing them, with the
        decodes of the small variants held queued (with ``free_link``, were fetching free)."""
        small, large = self._options[i]
        with self._cond:
            queued = sum(self.planner.decode_s(self._options[j][0], self.chunks[j].end - self.chunks[j].start)
                         for j in self._back)
        outcome = self.chunks[i]
        return self.planner.worth_loading(small, large, outcome.end - outcome.start, self.end - outcome.start,
                                          queued, free_link=free_link)

    def _weighed(self, i: int) -> tuple[Option, ...]:
        """The variants the planner weighs for chunk ``i``, smallest first."""
        return tuple(o for o in self._options[i] if o is not None)

    def _arrives_in_time(self, i: int, done: int = 0, slower: float = 1.0) -> str | None:
        """The rule by which chunk ``i``'s largest variant is read (the rest of it after ``done`` bytes): it can,
        read from now on a link ``slower`` times slower than estimated and decoded, be in before the decoder, working
        backwards through the small variants of the chunks after it, has decoded this chunk's small one (always,
        until the store has decoded the small variant: the first load that could find out does); None when it
        cannot."""
        small, large = self._options[i]
        if not self.planner.decode_known(small):
            return SMALL_UNMEASURED
        assert large is not None
        tokens = self.chunks[i].end - self.chunks[i].start
        with self._cond:
            ahead = sum(1 for j in self._back if j > i) * self.planner.decode_s(small, tokens) + self._decoding_left_s()
        in_time = slower * self.planner.fetch_s(large, large.nbytes - done) + self.planner.decode_s(large, tokens) < \
            ahead + self.planner.decode_s(small, tokens)
        return LARGE_IN_TIME if in_time else None

    def _decodes_queued_s(self) -> float:
        """The estimated rest of the decode under way and the decodes of the small variants held.  Under ``_cond``."""
        return self._decoding_left_s() + sum(
            self.planner.decode_s(self._options[j][0], self.chunks[j].end - self.chunks[j].start) for j in self._back)

    def _decoding_left_s(self) -> float:
        """The estimated rest of the decode under way."""
        if self._decoding is None:
            return 0.0
        since, estimate = self._decoding
        return max(0.0, estimate - (time.perf_counter() - since))

    def _read_large(self, i: int, rule: str | None) -> bool:
        """Read chunk ``i``'s largest variant and hold it, by ``rule``, or (None) as a probe of the link; False when
        it cannot be probed (its tier reads values only whole).  See :meth:`_read_pieces`."""
        outcome, large = self.chunks[i], self._options[i][1]
        assert large is not None
        key = outcome.keys[large.variant]
        t0 = time.perf_counter()
        if self.source.tier(large.tier).ranged_reads:
            chunk, rule = self._read_pieces(i, large, key, rule)
        elif rule is None:
            return False
        else:
            with self._cond:
                self._reading = _Reading(i, large, t0, large.nbytes, 0)
                state = self._decoder_state()
            chunk = self._read(i, key)
            if chunk is not None:
                self._observe(large, large.nbytes, time.perf_counter() - t0, state)
        with self._cond:
            self._reading = None
        outcome.fetch_s += time.perf_counter() - t0
        if chunk is not None:
            weighed = self._weighed(i)
            self._upgrades[i] = self.planner.decide(rule or LARGE_PROBED, weighed[-1].variant, weighed)
            self._hold(i, chunk, front=True)
        return True

    def _read_pieces(self, i: int, large: Option, key: str, rule: str | None) -> tuple[FetchedChunk | None, str | None]:
        """Read a large value in pieces, each about ``PIECE_S`` at the link's speed as estimated then (the first
        ``PIECE_BYTES[0]``, to measure the link before committing to more), or ``PROBE_BYTES`` while it is a probe
        (``rule`` None).  Before each piece the rule is weighed again (:meth:`_arrives_in_time`, a read not yet by
        rule on a link ``INSURANCE`` times slower): a probe whose rest can now be in in time becomes a read by rule,
        its pieces doubling from the probe's; a read whose rest will be late becomes a probe.  A probe reads within
        its budget (``PROBE_SHARE``, ``PROBE_DUTY``) and gives up once it is spent; a probe piece that looks like a
        rise counts only once a ``CONFIRM_BYTES`` piece confirms it.  Between pieces: read the small variants the
        decoder could now need, and give the value up once the decoder took the chunk (a video player's abandonment
        rule); a value given up otherwise keeps its pieces for the next read of it.  The chunk, or None; and the
        rule it was read by."""
        source, link = self.source, self.telemetry.link(large.tier)
        with self._cond:
            parts = self._resume.pop(i, [])  # what an earlier read of this value gave up: it goes on from there
        got, last = sum(map(len, parts)), len(parts[-1]) if parts else 0
        resumed = got
        confirm = False  # the last probe piece looked like a rise: the next confirms it, at once
        read_s = 0.0  # this read's pieces' seconds
        began: tuple[float, tuple[bool, int]] | None = None  # its first piece's start and the decoder's state then
        probed = False  # a probe's pieces (and waits) were part of it: its time is no measure of the link
        while got < large.nbytes:
            rule = self._arrives_in_time(i, got, slower=1.0 if rule is not None else INSURANCE)
            while self._read_small(i):  # the insurance: a link that slowed makes small variants needed
                pass
            with self._cond:  # between pieces: give up what will not be used
                self._late_from = len(self.chunks) if rule is not None else i
                want = CONFIRM_BYTES if confirm else PROBE_BYTES  # a probe's next piece
                if rule is None and self._probe_left < want:
                    self._probe_left = 0
                probe = self._probe_left and i >= self._low  # a probe waits: not while small variants are to read
                if i in self._taken or i >= self._limit or self._stop.is_set() or not (rule or probe):
                    log.debug("chunk %d: the large variant given up after %d of its %d bytes", i, got, large.nbytes)
                    if parts and i not in self._taken and i < self._limit:
                        self._resume[i] = parts  # the chunk may still come large: keep what is in
                    return None, rule
                length = want if rule is None else self._piece_bytes(link, last)
                if large.nbytes - got < 2 * length:
                    length = large.nbytes - got
                self._reading = _Reading(i, large, time.perf_counter(), length, large.nbytes - got - length)
                probed = probed or rule is None
                if began is None:
                    began = (time.perf_counter(), self._decoder_state())
            hint = rule is None and length < CONFIRM_BYTES  # a probe piece: judged before it moves the estimate
            piece, seconds = self._read_piece(i, large, key, got, length, observe=not hint)
            if not piece:
                return self._read(i, key), rule  # gone here: any tier holding it
            confirm = hint and len(piece) > LINK_FOLLOW * link.throughput.estimate * seconds
            if hint and not confirm:  # a burst only makes a read look faster: a steady or slower piece is the link
                source.observe(large.tier, len(piece), seconds)
            parts.append(piece)
            read_s += seconds
            got, last = got + len(piece), len(piece)
            with self._cond:
                measured = seconds > 0 and link.measures(len(piece), seconds)  # (not a round trip's time)
                self._reading = _Reading(i, large, time.perf_counter(), 0, large.nbytes - got,
                                         len(piece) / seconds if measured else math.inf,
                                         getattr(link.throughput, "measured_at", None))
                self._cond.notify_all()  # the decoder may be deciding whether to wait for this chunk
                if rule is None:
                    self._probe_left -= len(piece)
                if rule is None and not confirm:  # its budget spread over the decodes queued, PROBE_DUTY at most
                    pieces_left = max(self._probe_left, 1) / PROBE_BYTES
                    until = time.perf_counter() + max(seconds * (1 / PROBE_DUTY - 1),
                                                      self._decodes_queued_s() / pieces_left)
                    while i not in self._taken and not self._stop.is_set() and time.perf_counter() < until:
                        self._cond.wait(until - time.perf_counter())
        chunk = self._pieces_checked(i, large, key, parts, read_s)
        if chunk is None:
            return self._read(i, key), rule
        if began is not None and not probed:
            self._observe(large, got - resumed, time.perf_counter() - began[0], began[1])
        return chunk, rule

    def _decoder_state(self) -> tuple[bool, int]:
        """Whether a small variant's decode is under way, and how many have started (under ``_cond``)."""
        return self._decoding_small, self._small_decodes

    def _observe(self, option: Option, nbytes: int, seconds: float, before: tuple[bool, int]) -> None:
        """A large value's whole read, its pieces and its check (``seconds`` for ``nbytes``), for
        :class:`~kvcodec.store.telemetry.Contention` where one small variant's decode ran all through it or none at
        any time (the decoder's state ``before`` it and now are the same).

        A whole value, not each piece: inside vLLM at 10 Gbit/s pieces of 1-10 ms varied 10x with the shaper's
        bursts and the pieces beside a kvtc decode looked faster than those without (all 16 pairs a load kept were
        under 1, so a decode looked free), while the fetch thread's work per chunk, its reads and the value's
        check, took about 3x as long beside the decode (a raw chunk every 90-110 ms during it, every 35 ms after)."""
        with self._cond:
            now = self._decoder_state()
        if now == before:
            self.telemetry.link(option.tier).contention.observe(nbytes, seconds, beside_decode=now[0])

    def _decode(self) -> None:
        try:
            while (taken := self._take()) is not None:
                i, chunk, small, decision = taken
                outcome = self.chunks[i]
                self._decided(i, decision)
                t0 = time.perf_counter()
                variant = self._variant_of(i, chunk)
                with self._cond:
                    self._decoding = (t0, self.planner.decode_s(Option(variant, 0, chunk.tier), chunk.end - chunk.start))
                    self._decoding_small = small
                    self._small_decodes += small
                try:
                    self._check_shape(chunk)
                    decode_chunk_into(chunk, self.sink, self.start_token, self.end,
                                      max_bytes=self.source.max_bytes(chunk.end - chunk.start), device=self.device,
                                      on_layer=lambda layer, i=i: self._layer_in(i, layer))
                except Exception as err:
                    outcome.decode_s = time.perf_counter() - t0
                    outcome.error = f"{type(err).__name__}: {err}"
                    log.warning("stored chunk %s (tokens %d-%d) did not load: %s", chunk.key, chunk.start,
                                chunk.end - 1, outcome.error)
                    self.source.discard(chunk, err)
                    self._end_at(i, "failed")
                    continue
                finally:
                    with self._cond:
                        self._decoding, self._decoding_small = None, False
                outcome.decode_s = time.perf_counter() - t0
                self._used(i, chunk.key)
                outcome.status, outcome.variant, outcome.tier = "loaded", variant, chunk.tier
                self.telemetry.decode_rate(self.variants[outcome.variant]).observe(chunk.end - chunk.start,
                                                                                  outcome.decode_s)
        except BaseException:  # noqa: BLE001
            log.warning("loading a stored prefix failed", exc_info=True)
        finally:
            self._stop.set()
            self._seconds = time.perf_counter() - self._t0
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _variant_of(self, i: int, chunk: FetchedChunk) -> int:
        return self.chunks[i].keys.index(chunk.key)

    def _decided(self, i: int, decision: Decision) -> None:
        outcome = self.chunks[i]
        outcome.decision = decision
        log.debug("chunk %d (tokens %d-%d): %s", i, outcome.start, outcome.end - 1, self.planner.describe(decision))

    def _take(self) -> tuple[int, FetchedChunk, bool, Decision] | None:
        """The next chunk to decode (whether it is a small variant from the back, and why it is this variant): the
        lowest fetched from the front, else the highest small variant, unless the large variants the fetch is
        bringing would have that chunk in and decoded sooner than its small one would decode (then the decoder
        stays free for them), or decoding it would slow the link by more than it saves, while large variants are
        still coming; None when every chunk is done."""
        with self._cond:
            while not self._stop.is_set():
                live = [i for i in range(self._limit) if i not in self._taken]
                if not live:
                    return None
                pick = next((i for i in live if i in self._front), None)
                if pick is None:
                    backs = [i for i in live if i in self._back]
                    if backs and (self._fetched_all or self._full or
                                  (self._link_timed(backs[-1]) and self._small_pays(backs[-1])
                                   and not self._large_sooner(backs[-1]))):
                        pick = backs[-1]
                    elif not backs and self._fetched_all:
                        self._limit = live[0]  # nothing more is coming for it: the engine's
                        if self.chunks[live[0]].status == "skipped":
                            self.chunks[live[0]].status = "missing"
                        continue
                if pick is not None:
                    small = pick not in self._front
                    decision = self._why(pick, small)
                    self._taken.add(pick)
                    self._resume.pop(pick, None)
                    chunk = self._front.pop(pick, None) or self._back.pop(pick)
                    for other in (self._front.pop(pick, None), self._back.pop(pick, None), chunk):
                        self._held_bytes -= 0 if other is None else len(other.data)
                    self._cond.notify_all()
                    return pick, chunk, small, decision
                self._cond.wait(0.005)
            return None

    def _why(self, i: int, small: bool) -> Decision:
        """Why the decoder takes chunk ``i`` from the front (its large variant, or the only one) or the back."""
        if i not in self._options:  # one variant stored: read in order
            chunk = self._front[i]
            option = Option(self._variant_of(i, chunk), self._value_bytes[i, chunk.key], chunk.tier)
            return self.planner.decide(ONE_VARIANT, option.variant, (option,))
        if not small:
            return self._upgrades[i]
        lo, hi = self._options[i]
        if hi is None:
            rule = ONE_VARIANT
        elif self._reading is not None and self._reading.chunk == i:
            rule = LARGE_TOO_LATE  # the decoder stopped waiting for it
        elif self._fetched_all:
            rule = LARGE_TOO_LATE if i >= self._late_from else LARGE_NOT_COMING
        elif i >= self._late_from:
            rule = LARGE_TOO_LATE
        else:
            rule = SMALL_PAYS if self._small_pays(i) else BUDGET_FULL
        return self.planner.decide(rule, lo.variant, self._weighed(i))

    def _small_pays(self, i: int) -> bool:
        small, large = self._options[i]
        return large is None or self.planner.small_pays(small, large, self.chunks[i].end - self.chunks[i].start)

    def _link_timed(self, i: int) -> bool:
        """Whether the estimates may start chunk ``i``'s small decode: its large variant's link was timed within
        ``FRESH_S`` (:meth:`~kvcodec.store.telemetry.Link.timed`), or the load has read for ``UNTIMED_WAIT_S``."""
        large = self._options[i][1]
        if large is None or time.perf_counter() - self._reads_t0 >= UNTIMED_WAIT_S:
            return True
        link = self.telemetry.link(large.tier)
        # (a test's pinned estimate has no time: it is what the planner believes)
        return not hasattr(link.throughput, "measured_at") or link.timed(FRESH_S)

    def _large_sooner(self, i: int) -> bool:
        """Whether the load ends sooner with chunk ``i``'s large variant, coming in the fetch's order, than with the
        decoder taking its small variant now.  The small decode holds the decoder: the large chunks before ``i``
        that arrive meanwhile wait behind it, and its contention slows their reads.  Under ``_cond``."""
        small, tokens = self._options[i][0], self.chunks[i].end - self.chunks[i].start
        large = self._options[i][1]
        large_end = self._large_eta_s(i)
        if large is None or math.isinf(large_end):
            return False
        # The decodes of the large chunks before i, still to come: on a fast link they all arrive during a slow
        # small decode and then queue (inside vLLM at 10 Gbit/s, raw chunks about 20 ms each behind a 0.25 s kvtc
        # decode: a first request's load 1.5-3x raw's).  Comparing the large ETA with the small decode alone missed it.
        front = [k for k in range(min(i, self._late_from)) if k not in self._taken and self._options[k][1] is not None]
        behind = sum(self.planner.decode_s(self._options[k][1], self.chunks[k].end - self.chunks[k].start)
                     for k in front)
        small_s = self.planner.decode_s(small, tokens)
        before = self._large_eta_s(front[-1]) if front else 0.0  # (finite: front holds chunks whose large comes)
        before += min(small_s, before) * (1 - 1 / self.planner.slowdown(large))  # its reads, slowed beside the decode
        with_small = max(before, small_s + behind)
        with_large = max(large_end, behind + self.planner.decode_s(large, tokens))
        return with_large < with_small

    def _check_shape(self, chunk: FetchedChunk) -> None:
        """Without an engine shape the store checked against, every chunk must match the first one's."""
        assert chunk.header is not None
        shape = ChunkShape.of_header(chunk.header)
        if self._shape is None:
            self._shape = shape
        elif shape != self._shape:
            raise CorruptDataError(f"{chunk.key} holds layers of {shape}, the chunks before it {self._shape}")

    def _layer_in(self, i: int, layer: int) -> None:
        with self._cond:
            self._layers_done[i] = layer + 1
            ready = self._ready_layers()
            while len(self.layer_ready_s) < ready:
                self.layer_ready_s.append(time.perf_counter() - self._t0)
            self._cond.notify_all()

    def _ready_layers(self) -> int:
        """Layers that hold every token of the load (none of a load that ends short: it says so when it ends)."""
        return min(self._layers_done, default=0)

    # -- waiting ------------------------------------------------------------------------------------
    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until layer ``layer`` holds every token of the load, or the load ended short of it; True when the
        layer holds every token."""
        self.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished or self._ready_layers() > layer, timeout):
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
