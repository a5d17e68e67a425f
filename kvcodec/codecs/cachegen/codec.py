"""``cachegen``: CacheGen (Liu et al., SIGCOMM 2024) with steps chosen for attention.

Each layer section holds a keys part and a values part.  Within a part every
channel ``c = h * D + d`` of the chunk is quantized with a uniform step

    x_hat[c, t] = mu[c] + q[c, t] * step[c, t],   step[c, t] = a[h, t] * b[c]

where ``mu`` is the channel's mean (float16), ``b`` a per-channel step and ``a``
a per-token scale (values only: tokens differ in magnitude, and the most
attended ones, like the first, are often the smallest).  Steps are stored as
one-byte codes on a 2**(1/8) grid (:data:`kvcodec.codecs.entropy.tables.STEPS`).  Symbols ``q`` are
entropy coded with one table per channel, chosen from a fixed codebook of
discretized Gaussians (one byte each), in lanes of ``lane_channels`` channels
by ``lane_tokens`` tokens that are independent ANS streams.

How steps are chosen is the encoder's business (decoders only read them): with
a model profile (:mod:`kvcodec.profiles`), a key channel's step is inversely
proportional to the RMS of the queries that read it, so the attention logits
get an even error at the fewest bits; value steps follow the output
projection's column norms.  Without a profile, keys fall back to steps
proportional to each channel's spread.

The first ``sink_tokens`` tokens of the sequence are also stored exactly (float16
after the two parts): attention piles onto them, so their error costs most.

``group > 1`` turns on CacheGen's anchor/delta coding: the first token of every
``group`` tokens is coded at a quarter of the step, the others as deltas from
its reconstruction.  Measured on real KV it costs bits (see docs/codecs/cachegen.md), so it
is off by default.

Two engines do the heavy passes and make the same bytes: numpy and constriction
(:class:`CpuEngine`), and the Triton kernels in ``kvcodec/kernels/cachegen.py``
(:mod:`kvcodec.codecs.cachegen.device`), chosen by ``LayerContext.backend``:
``"auto"`` runs the kernels for CUDA tensors.  They agree because every
statistic the encoder derives a choice from is a float64 sum that is exact for
float16 input (spec/cachegen.md §10.3), and quantization and reconstruction are defined
in float64 where each product is exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcodec.codecs.base import Codec, LayerContext
from kvcodec.codecs.cachegen.device import TritonEngine
from kvcodec.codecs.cachegen.parts import Part, Side, with_sinks
from kvcodec.codecs.entropy.lanes import Run, decode_lane, encode_lane, table_runs
from kvcodec.codecs.entropy.sections import SectionBytes
from kvcodec.codecs.entropy.tables import NUM_TABLES, RADIX, STEPS, choose_tables, step_code
from kvcodec.codecs.registry import register_codec
from kvcodec.errors import CorruptDataError, InvalidInputError, UnsupportedError

ANCHOR_SHRINK = np.float32(0.25)  # anchors use a quarter of the step: exact in float32
MAX_LANE_SYMBOLS = 1 << 16  # keeps every lane under 65536 words, so lane lengths fit a u16

# Per level: (key step, value step) multipliers for the shallow, middle and deep thirds of the layers,
# set from measurements on SmolLM2 (bench/results/rate_distortion.md).
LEVELS: dict[int, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    0: ((4.0, 4.0, 4.0), (1.4, 1.4, 1.4)),
    1: ((3.0, 3.0, 3.0), (1.0, 1.0, 1.0)),
    2: ((2.5, 2.5, 2.5), (0.7, 0.7, 0.7)),
    3: ((1.5, 1.5, 1.5), (0.5, 0.5, 0.5)),
    4: ((0.8, 0.8, 0.8), (0.3, 0.3, 0.3)),
}
DEFAULT_LEVEL = 2
FALLBACK_KEY_STEP = 0.25  # keys without a profile: matches the profile path's quality at equal level on SmolLM2
# Token scales come from the mean absolute value (a sum the GPU adds exactly, unlike a sum of squares),
# times sqrt(pi/2) so that they match the RMS on Gaussian data, which the levels were tuned with.
VALUE_SCALE = float(np.sqrt(np.pi / 2))


@register_codec
class CacheGen(Codec):
    """CacheGen: query-aware uniform quantization, per-channel Gaussian tables, lane-parallel ANS."""

    codec_id = "cachegen"
    lossless = False
    uses_profile = True
    backends = ("cpu", "triton")

    def __init__(self, level: int = DEFAULT_LEVEL, group: int = 1, lane_channels: int = 64, lane_tokens: int = 256,
                 profile: str = "auto", sink_tokens: int = 1) -> None:
        def positive_int(name: str, v: Any, hi: int) -> int:
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                raise InvalidInputError(f"cachegen {name} must be an integer in 1..{hi}, not {v!r}")
            return v

        if not isinstance(level, int) or level not in LEVELS:
            raise InvalidInputError(f"cachegen level must be one of {sorted(LEVELS)}, not {level!r}")
        self.level = level
        self.group = positive_int("group", group, 64)
        self.lane_channels = positive_int("lane_channels", lane_channels, 4096)
        self.lane_tokens = positive_int("lane_tokens", lane_tokens, MAX_LANE_SYMBOLS)
        if lane_channels * lane_tokens > MAX_LANE_SYMBOLS:
            raise InvalidInputError(f"cachegen lane_channels * lane_tokens must be at most {MAX_LANE_SYMBOLS}")
        if not isinstance(profile, str):
            raise InvalidInputError(f"cachegen profile must be 'auto', 'none' or a profile file, not {profile!r}")
        self.profile = profile
        if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or not 0 <= sink_tokens <= 1024:
            raise InvalidInputError(f"cachegen sink_tokens must be an integer in 0..1024, not {sink_tokens!r}")
        self.sink_tokens = sink_tokens

    @classmethod
    def presets(cls) -> list[dict[str, Any]]:
        return [{"level": level} for level in sorted(LEVELS)]

    def get_config(self) -> dict[str, Any]:
        return {"level": self.level, "group": self.group, "lane_channels": self.lane_channels,
                "lane_tokens": self.lane_tokens, "profile": self.profile, "sink_tokens": self.sink_tokens}

    # --- step choice (encoder only) ---------------------------------------------------

    def _multipliers(self, ctx: LayerContext) -> tuple[float, float]:
        band = min(3 * ctx.layer // max(ctx.num_layers, 1), 2)
        keys, values = LEVELS[self.level]
        return keys[band], values[band]

    def _weights(self, ctx: LayerContext) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        from kvcodec.profiles import Profile, find_profile

        if self.profile == "none":
            return None, None
        prof = find_profile(ctx.model) if self.profile == "auto" else Profile.load(self.profile)
        weights = prof.layer_weights(ctx.layer, ctx.shape) if prof is not None else None
        return weights if weights is not None else (None, None)

    @staticmethod
    def _key_steps(spread: np.ndarray, weight: torch.Tensor | None, mult: float) -> np.ndarray:
        """Key step targets from the profile, or from each channel's mean absolute value ``spread`` [H, D]."""
        if weight is not None:
            # equal logit error per channel: the step is inversely proportional to the query RMS on it
            return (mult / np.maximum(weight.numpy(), 1e-6)).reshape(-1)
        # Without a profile, a channel pair's own spread stands in for the queries' (in trained models the
        # large query and key pairs coincide); the head's spread keeps the step in the keys' units.
        half = spread.shape[1] // 2
        pair = np.concatenate([(spread[:, :half] + spread[:, half:2 * half]) / 2, spread[:, 2 * half:]], 1)
        pair = np.concatenate([pair[:, :half], pair], 1) if half else pair
        head = spread.mean(1, keepdims=True)
        return (FALLBACK_KEY_STEP * mult * head / np.maximum(pair, 1e-6)).reshape(-1)

    @staticmethod
    def _value_steps(weight: torch.Tensor | None, mult: float, heads: int, dim: int) -> np.ndarray:
        if weight is None:
            return np.full(heads * dim, mult)
        rel = weight.mean(-1, keepdim=True) / weight.clamp_min(1e-6)
        return (mult * rel).reshape(-1).numpy()

    # --- encode -------------------------------------------------------------------------

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        return self.encode_layers([(keys, values)], [ctx])[0]

    def encode_layers(self, layers: list[tuple[torch.Tensor, torch.Tensor]], ctxs: list[LayerContext]) -> list[bytes]:
        engine_class = self._engine(ctxs[0], layers[0][0].device)
        if engine_class is CpuEngine and len(layers) > 1:  # nothing to gain on a CPU, and memory to lose
            return [self.encode_layers([pair], [ctx])[0] for pair, ctx in zip(layers, ctxs)]
        # Every layer of a chunk at once: on a GPU each pass is then one launch over all of them.
        xs = [x for pair in layers for x in pair]
        engine = engine_class(self, xs)
        stats = engine.stats()
        # float64 sums of finite float32 values cannot overflow: a non-finite sum means a non-finite input
        if not all(np.isfinite(total).all() for total, _, _ in stats):
            raise InvalidInputError("cachegen cannot encode non-finite values (NaN or inf)")
        sides = []
        for i, ctx in enumerate(ctxs):
            (kw, vw), (mk, mv) = self._weights(ctx), self._multipliers(ctx)
            for x, (total, absolute, token_absolute), is_values in zip(layers[i], stats[2 * i:2 * i + 2], (False, True)):
                h, t, d = x.shape
                if is_values:
                    a_code = step_code(token_absolute * (VALUE_SCALE / d)).reshape(-1)
                    b_target = self._value_steps(vw, mv, h, d)
                else:
                    a_code, b_target = None, self._key_steps(absolute.reshape(h, d) / t, kw, mk)
                mu = (total / t).astype(np.float32).astype(np.float16)
                sides.append(Side(mu, step_code(b_target), a_code))
        for _ in range(8):
            fits = True
            for side, (worst, table, anchor_table) in zip(sides, engine.symbol_range(sides)):
                side.table, side.anchor_table = table, anchor_table
                over = worst > RADIX
                if over.any():
                    # a symbol out of range: coarsen that channel's step just enough
                    side.b_code[over] = np.minimum(255, side.b_code[over].astype(np.int64) + 1
                                                   + np.ceil(8 * np.log2(worst[over] / RADIX)).astype(np.int64))
                    fits = False
            if fits:
                break
        else:
            raise InvalidInputError("cachegen could not fit the values into its symbol range")
        coded = [b"".join(side.pack() + [lengths.astype("<u2").tobytes(), words])
                 for side, (lengths, words) in zip(sides, engine.encode_lanes(sides))]
        out = []
        for i, ctx in enumerate(ctxs):
            sinks = self._sinks(ctx)
            exact = [_as_float32(x[:, :sinks]).astype("<f2").tobytes() for x in layers[i]] if sinks else []
            out.append(b"".join(coded[2 * i:2 * i + 2] + exact))
        return out

    def _sinks(self, ctx: LayerContext) -> int:
        """How many of this section's tokens are attention sinks, kept exactly (as float16)."""
        return max(0, min(self.sink_tokens - ctx.token_start, ctx.shape.tokens))

    def _engine(self, ctx: LayerContext, device: torch.device) -> type:
        """The class that does the heavy passes: the Triton kernels or numpy and constriction."""
        use_triton = ctx.backend == "triton" or (ctx.backend == "auto" and device.type == "cuda" and self.group == 1)
        if not use_triton:
            return CpuEngine
        if self.group != 1:
            raise UnsupportedError("cachegen's Triton kernels code group=1 only (anchor/delta groups run on the CPU)")
        return TritonEngine

    def plan(self, channels: int, tokens: int, table: np.ndarray, anchor_table: np.ndarray | None) -> list[list[Run]]:
        """The lanes of a part, each a list of runs.

        A lane covers ``lane_channels`` channels by ``lane_tokens`` tokens.  Its
        channels are taken in order of their table (stable), so every table
        used in the lane is one run: first the anchor runs (source ``"anchor"``,
        columns index the anchors), then the delta runs (source ``"q"``).
        Encoder and decoder both follow this plan.
        """
        lanes = []
        for c0 in range(0, channels, self.lane_channels):
            chans = np.arange(c0, min(c0 + self.lane_channels, channels))
            for t0 in range(0, tokens, self.lane_tokens):
                t1 = min(t0 + self.lane_tokens, tokens)
                if anchor_table is None:
                    runs = table_runs("q", chans, slice(t0, t1), t1 - t0, table)
                else:
                    tok = np.arange(t0, t1)
                    is_anchor = tok % self.group == 0
                    anchor_cols, delta_cols = tok[is_anchor] // self.group, tok[~is_anchor]
                    runs = (table_runs("anchor", chans, anchor_cols, len(anchor_cols), anchor_table)
                            + table_runs("q", chans, delta_cols, len(delta_cols), table))
                lanes.append(runs)
        return lanes

    # --- decode -------------------------------------------------------------------------

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_layers([data], [ctx])[0]

    def decode_layers(self, datas: list[bytes], ctxs: list[LayerContext]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parsed = [self.parse(data, ctx) for data, ctx in zip(datas, ctxs)]
        engine = self._engine(ctxs[0], ctxs[0].device)
        if engine is CpuEngine:
            out = []
            for (parts, sinks), ctx in zip(parsed, ctxs):
                (keys, _), (values, _) = (self._reconstruct(p) for p in parts)
                out.append((with_sinks(_to_tensor(keys, ctx), sinks[0]), with_sinks(_to_tensor(values, ctx), sinks[1])))
            return out
        return engine.decode_contiguous(self, parsed, ctxs)

    def decode_layer_paged(self, data: bytes, ctx: LayerContext, paged: torch.Tensor, slots: torch.Tensor,
                           layout: Any = "flash") -> None:
        engine = self._engine(ctx, paged.device)
        if engine is CpuEngine:
            return super().decode_layer_paged(data, ctx, paged, slots, layout)
        engine.decode_paged(self, self.parse(data, ctx), paged, slots, layout)

    def error_bounds(self, data: bytes, ctx: LayerContext) -> tuple[np.ndarray, np.ndarray]:
        """The largest error each decoded key and value element can have (half its step), ``[H, T, D]``,
        before rounding to the output dtype."""
        parts, sinks = self.parse(data, ctx)
        (_, kb), (_, vb) = (self._reconstruct(p) for p in parts)
        for bound, sink in zip((kb, vb), sinks):
            bound[:, :sink.shape[1]] = 0
        return kb, vb

    def parse(self, data: bytes, ctx: LayerContext) -> tuple[list[Part], list[np.ndarray]]:
        """A section's two parts and its sink tokens (float16 ``[H, S, D]`` each), every length checked."""
        s = ctx.shape
        reader = SectionBytes(memoryview(data))
        parts = [self._parse_part(reader, s.heads, s.tokens, d, token_scale=v) for d, v in ((s.key_dim, False),
                                                                                            (s.value_dim, True))]
        sinks = self._sinks(ctx)
        exact = [reader.take(s.heads * sinks * d, "<f2").reshape(s.heads, sinks, d) for d in (s.key_dim, s.value_dim)]
        if reader.pos != len(data):
            raise CorruptDataError(f"cachegen section has {len(data) - reader.pos} bytes too many")
        return parts, exact

    def _parse_part(self, reader: SectionBytes, h: int, t: int, d: int, token_scale: bool) -> Part:
        c = h * d
        n_lanes = -(-c // self.lane_channels) * -(-t // self.lane_tokens)
        mu = reader.take(c, "<f2")
        b_code = reader.take(c, "u1")
        table = reader.take(c, "u1")
        anchor_table = reader.take(c, "u1") if self.group > 1 else None
        a_code = reader.take(h * t, "u1") if token_scale else None
        lengths = reader.take(n_lanes, "<u2").astype(np.int64)
        if int(table.max(initial=0)) >= NUM_TABLES or (anchor_table is not None and int(anchor_table.max(initial=0)) >= NUM_TABLES):
            raise CorruptDataError("cachegen section names a table outside the codebook")
        if not np.isfinite(mu).all():
            raise CorruptDataError("cachegen section has non-finite channel means")
        words = reader.take(int(lengths.sum()), "<u4")
        return Part((h, t, d), Side(mu, b_code, a_code, table, anchor_table), lengths, words)

    def symbols(self, part: Part) -> tuple[np.ndarray, np.ndarray | None]:
        """A part's symbols ``[C, T]`` (and its anchor symbols when ``group > 1``), decoded from its lanes."""
        h, t, d = part.shape
        q = np.zeros((h * d, t), np.int64)
        qa = np.zeros((h * d, -(-t // self.group)), np.int64) if self.group > 1 else None
        targets = {"q": q, "anchor": qa}
        offsets = np.concatenate([[0], np.cumsum(part.lengths)])
        for k, runs in enumerate(self.plan(h * d, t, part.side.table, part.side.anchor_table)):
            words = part.words[offsets[k]:offsets[k + 1]].astype(np.uint32)
            for r, symbols in zip(runs, decode_lane(words, [(r.size, r.table) for r in runs])):
                r.scatter(targets[r.source], symbols)
        return q, qa

    def _reconstruct(self, part: Part) -> tuple[np.ndarray, np.ndarray]:
        """``(x, half step)``, both ``[H, T, D]`` float32, of a part, on the CPU (spec/cachegen.md §10.3)."""
        h, t, d = part.shape
        side = part.side
        q, qa = self.symbols(part)
        step = _steps(side.token_steps(h, t), side.b_code, d)
        m = side.mu.astype(np.float64)[:, None]
        if qa is None:
            xc = (m + q * step.astype(np.float64)).astype(np.float32)
        else:
            anchor_idx = np.arange(0, t, self.group)
            anchor_step = step[:, anchor_idx] * ANCHOR_SHRINK
            xa = (m + qa * anchor_step.astype(np.float64)).astype(np.float32)
            xc = (xa[:, np.arange(t) // self.group].astype(np.float64) + q * step.astype(np.float64)).astype(np.float32)
            xc[:, anchor_idx] = xa
            step[:, anchor_idx] = anchor_step

        def to_htd(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a.reshape(h, d, t).transpose(0, 2, 1))

        return to_htd(xc), to_htd(step / 2)


class CpuEngine:
    """The encoder's heavy passes on the CPU: numpy for statistics and quantization, constriction for ANS."""

    def __init__(self, codec: CacheGen, xs: list[torch.Tensor]) -> None:
        self.codec = codec
        self.shapes = [tuple(x.shape) for x in xs]
        # [C, T] in binary64: the sums below are then exact for float16 input (spec/cachegen.md §10.3)
        self.xs = [np.ascontiguousarray(_as_float32(x).transpose(0, 2, 1), dtype=np.float64)
                   .reshape(x.shape[0] * x.shape[2], x.shape[1]) for x in xs]
        self.symbols: list[tuple[np.ndarray, np.ndarray | None]] = []

    def stats(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        out = []
        for i, (x, (h, t, d)) in enumerate(zip(self.xs, self.shapes)):
            absolute = np.abs(x)
            token_absolute = absolute.reshape(h, d, t).sum(1) if i % 2 else None  # values parts only
            out.append((x.sum(1), absolute.sum(1), token_absolute))
        return out

    def symbol_range(self, sides: list[Side]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        out, self.symbols = [], []
        group = self.codec.group
        for x, (h, t, d), side in zip(self.xs, self.shapes, sides):
            q, anchors = _quantize(x, side.mu, _steps(side.token_steps(h, t), side.b_code, d), group)
            self.symbols.append((q, anchors))
            worst = np.abs(q).max(1, initial=0)
            if anchors is None:
                out.append((worst, choose_tables(q), None))
            else:
                worst = np.maximum(worst, np.abs(anchors).max(1, initial=0))
                out.append((worst, choose_tables(np.delete(q, np.arange(0, t, group), axis=1)), choose_tables(anchors)))
        return out

    def encode_lanes(self, sides: list[Side]) -> list[tuple[np.ndarray, bytes]]:
        out = []
        for (q, anchors), (_, t, _), side in zip(self.symbols, self.shapes, sides):
            sources = {"q": q, "anchor": anchors}
            words, lengths = [], []
            for runs in self.codec.plan(q.shape[0], t, side.table, side.anchor_table):
                lane = encode_lane([(r.gather(sources[r.source]), r.table) for r in runs])
                words.append(lane.astype("<u4").tobytes())
                lengths.append(len(lane))
            out.append((np.array(lengths, np.int64), b"".join(words)))
        return out


def _steps(a: np.ndarray, b_code: np.ndarray, d: int) -> np.ndarray:
    """``step[c, t] = a[h, t] * b[c]`` in float32, channel ``c = h * d + j``."""
    b = STEPS[b_code].reshape(-1, d)  # [H, D]
    return (a[:, None, :] * b[:, :, None]).reshape(-1, a.shape[1])


def _quantize(xc: np.ndarray, mu: np.ndarray, step: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Symbols (and anchor symbols when ``group > 1``) of ``[C, T]`` float64 values (spec/cachegen.md §10.3)."""
    m = mu.astype(np.float64)[:, None]
    if group == 1:
        return np.rint((xc - m) / step).astype(np.int64), None
    idx = np.arange(xc.shape[1])
    anchor_idx = idx[::group]
    anchor_step = (step[:, anchor_idx] * ANCHOR_SHRINK).astype(np.float64)
    qa = np.rint((xc[:, anchor_idx] - m) / anchor_step).astype(np.int64)
    xa = (m + qa * anchor_step).astype(np.float32).astype(np.float64)
    q = np.rint((xc - xa[:, idx // group]) / step).astype(np.int64)
    q[:, anchor_idx] = 0
    return q, qa


def _to_tensor(x: np.ndarray, ctx: LayerContext) -> torch.Tensor:
    # numpy casts to float16 with the same round-to-nearest-even as torch, without torch's threading overhead
    if ctx.dtype == torch.float16:
        x = x.astype(np.float16)
    return torch.from_numpy(x).to(ctx.device, ctx.dtype)


def _as_float32(x: torch.Tensor) -> np.ndarray:
    x = x.detach().cpu()
    return (x.float() if x.dtype == torch.bfloat16 else x).numpy().astype(np.float32)
