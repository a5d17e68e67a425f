"""Resolution adaptation and a pipelined fetch simulator for ``kvfetcher`` streams (tooling: bench and tests use
it to choose and check a ladder; the runtime does not import it).

The stream is a sequence of *GOPs* (one container chunk of ``gop_tokens`` tokens:
every layer's K and V frames of those tokens, one closed GOP per section, so the
frame height can change only there).  Within a GOP every frame has the height the
policy picked, from a ladder such as 1024/512/256/128 token rows (never below the
decoder's minimum side, :data:`kvcodec.codecs.kvfetcher.video.MIN_SIDE`: a 128-row
frame is coded as a 144-row picture).

Model of time (deterministic; link model from :class:`kvcodec.tools.adaptation.BandwidthTrace`):

* One link sends frames back to back; a frame is usable once all its bytes arrived.
* One decoder (NVDEC, or FFmpeg on the CPU) decodes and restores frames in order,
  one at a time: frame ``i`` starts at ``max(arrival_i, done_{i-1})`` and takes
  ``decode_s[h]`` (a per-frame fixed cost plus a per-row cost, measured).
* *Pipelined*: as above.  *Sequential*: decoding starts once the whole stream arrived.
* Restored: when the last frame is decoded.

:class:`FrameModel` holds the per-height frame bytes and decode seconds (from real
encodes and real decode timings), :class:`ResolutionPolicy` picks the height of each
GOP from the :class:`kvcodec.store.telemetry.RateEstimator` estimate and the jitter of its
samples, and :func:`simulate_fetch` replays a trace.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvcodec.errors import InvalidInputError
from kvcodec.store.telemetry import LINK_PRIOR_BPS, RateEstimator
from kvcodec.tools.adaptation import BandwidthTrace

DEFAULT_LADDER = (1024, 512, 256, 128)


@dataclass(frozen=True)
class FrameModel:
    """Per frame height (token rows): compressed bytes of one frame and seconds to decode and restore it.

    ``frames_per_block`` frames of a height cover ``height`` tokens of every layer (2 x layers: K and V).
    """

    frame_bytes: dict[int, float]
    decode_s: dict[int, float]
    frames_per_block: int

    def __post_init__(self) -> None:
        if set(self.frame_bytes) != set(self.decode_s) or not self.frame_bytes:
            raise InvalidInputError("frame_bytes and decode_s need the same, non-empty set of heights")
        if any(b <= 0 for b in self.frame_bytes.values()) or any(d < 0 for d in self.decode_s.values()):
            raise InvalidInputError("frame bytes must be positive and decode times non-negative")

    @property
    def heights(self) -> tuple[int, ...]:
        return tuple(sorted(self.frame_bytes, reverse=True))

    @classmethod
    def linear(cls, heights: Sequence[int], bytes_per_row: float, header_bytes: float, decode_fixed_s: float,
               decode_row_s: float, frames_per_block: int, min_rows: int = 144) -> FrameModel:
        """A model from per-row costs: a frame of ``h`` rows is coded as ``max(h, min_rows)`` rows."""
        fb = {h: header_bytes + bytes_per_row * max(h, min_rows) for h in heights}
        ds = {h: decode_fixed_s + decode_row_s * max(h, min_rows) for h in heights}
        return cls(fb, ds, frames_per_block)

    def gop_frames(self, height: int, gop_tokens: int) -> int:
        return self.frames_per_block * math.ceil(gop_tokens / height)


@dataclass
class FetchResult:
    name: str
    restored_s: float
    arrived_s: float
    heights: list[int]
    peak_frames_held: int  # frames arrived but not yet decoded, at most (the decode buffer)
    bytes_sent: float
    frames: int = field(default=0)


def _pipeline(frames: Sequence[tuple[float, float]], trace: BandwidthTrace, start_s: float, dec_free: float,
              pipelined: bool = True) -> tuple[float, float, float, int]:
    """Send ``(bytes, decode_s)`` frames from ``start_s``; returns (link free, decoder free, last arrival, peak held)."""
    link, arrivals = start_s, []
    for nbytes, _ in frames:
        link = trace.transfer_end(link, nbytes)
        arrivals.append(link)
    done, peak = dec_free, 0
    starts = []
    for (nbytes, dec), arr in zip(frames, arrivals):
        begin = max(arr if pipelined else arrivals[-1], done)
        starts.append(begin)
        done = begin + dec
    # frames held: arrived but not started, counted at each arrival
    j = 0
    for i, arr in enumerate(arrivals):
        while j < len(starts) and starts[j] <= arr:
            j += 1
        peak = max(peak, i + 1 - j)
    return link, done, arrivals[-1] if arrivals else start_s, peak


class ResolutionPolicy:
    """Picks each GOP's frame height: the one whose predicted time to restore the *rest of the stream*
    is smallest, at a throughput of ``estimate / (1 + jitter_weight * cv)`` where ``cv`` is the
    coefficient of variation of the estimator's recent samples (a jittery link is planned for as a
    slower one, and then the finer pipeline of small frames pays off; a steady one gets large frames).

    ``decide(gop, gops, gop_tokens, now_s, decoder_free_s, estimator) -> height``.
    """

    def __init__(self, model: FrameModel, ladder: Sequence[int] | None = None, jitter_weight: float = 1.0) -> None:
        self.model = model
        self.ladder = tuple(ladder) if ladder is not None else model.heights
        if not self.ladder or any(h not in model.frame_bytes for h in self.ladder):
            raise InvalidInputError(f"ladder {self.ladder} needs heights the model knows: {model.heights}")
        self.jitter_weight = jitter_weight
        self.name = "adaptive ladder"

    @staticmethod
    def jitter(estimator: RateEstimator) -> float:
        s = estimator.samples
        if len(s) < 2:
            return 0.0
        return statistics.pstdev(s) / statistics.fmean(s)

    def predicted_s(self, height: int, gops_left: int, gop_tokens: int, now_s: float, decoder_free_s: float,
                    rate: float) -> float:
        """Predicted restore time of ``gops_left`` GOPs at ``height`` on a steady link of ``rate`` bytes/s."""
        n = self.model.gop_frames(height, gop_tokens) * gops_left
        b, d = self.model.frame_bytes[height], self.model.decode_s[height]
        first = now_s + b / rate
        # a pipeline of n equal frames: the slower stage sets the pace after the first frame arrives
        return max(first, decoder_free_s) + d + (n - 1) * max(b / rate, d)

    def decide(self, gop: int, gops: int, gop_tokens: int, now_s: float, decoder_free_s: float,
               estimator: RateEstimator) -> int:
        rate = estimator.estimate / (1.0 + self.jitter_weight * self.jitter(estimator))
        left = gops - gop
        return min(self.ladder, key=lambda h: (self.predicted_s(h, left, gop_tokens, now_s, decoder_free_s, rate), -h))


class FixedHeight:
    def __init__(self, height: int) -> None:
        self.height = height
        self.name = f"fixed {height}"

    def decide(self, *args, **kwargs) -> int:  # noqa: ANN002, ANN003
        return self.height


def simulate_fetch(model: FrameModel, trace: BandwidthTrace, total_tokens: int, gop_tokens: int,
                   policy: ResolutionPolicy | FixedHeight, *, pipelined: bool = True,
                   estimator: Callable[[], RateEstimator] = lambda: RateEstimator(LINK_PRIOR_BPS)) -> FetchResult:
    """Fetch ``total_tokens`` tokens (all layers) in GOPs of ``gop_tokens`` over ``trace``; heights from ``policy``."""
    if total_tokens <= 0 or gop_tokens <= 0:
        raise InvalidInputError("total_tokens and gop_tokens must be positive")
    est = estimator()
    gops = math.ceil(total_tokens / gop_tokens)
    link, dec_free, arrived, peak, sent, nframes = 0.0, 0.0, 0.0, 0, 0.0, 0
    heights, pending = [], []
    for g in range(gops):
        tokens = min(gop_tokens, total_tokens - g * gop_tokens)
        h = policy.decide(g, gops, gop_tokens, link, dec_free, est)
        if h not in model.frame_bytes:
            raise InvalidInputError(f"{policy.name} chose height {h}, which the model does not know")
        heights.append(h)
        n = model.gop_frames(h, tokens)
        frames = [(model.frame_bytes[h], model.decode_s[h])] * n
        if pipelined:
            start = link
            link, dec_free, arrived, p = _pipeline(frames, trace, link, dec_free)
            peak = max(peak, p)
            est.observe(sum(f[0] for f in frames), link - start)
        else:
            pending.extend(frames)
            start = link
            for nbytes, _ in frames:
                link = trace.transfer_end(link, nbytes)
            est.observe(sum(f[0] for f in frames), link - start)
            arrived = link
        sent += sum(f[0] for f in frames)
        nframes += n
    if not pipelined:
        dec_free = arrived + sum(d for _, d in pending)
        peak = len(pending)
    return FetchResult(policy.name + ("" if pipelined else " (sequential)"), dec_free, arrived, heights, peak, sent, nframes)
