"""``cachegen``: CacheGen (Liu et al., SIGCOMM 2024) with steps chosen for attention.

Each layer section holds a keys part and a values part.  Within a part every
channel ``c = h * D + d`` of the chunk is quantized with a uniform step

    x_hat[c, t] = mu[c] + q[c, t] * step[c, t],   step[c, t] = a[h, t] * b[c]

where ``mu`` is the channel's mean (float16), ``b`` a per-channel step and ``a``
a per-token scale (values only: tokens differ in magnitude, and the most
attended ones, like the first, are often the smallest).  Steps are stored as
one-byte codes on a 2**(1/8) grid (:data:`tables.STEPS`).  Symbols ``q`` are
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
its reconstruction.  Measured on real KV it costs bits (see the README), so it
is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcodec.codecs.base import Codec, LayerContext
from kvcodec.codecs.cachegen.lanes import decode_lane, encode_lane
from kvcodec.codecs.cachegen.tables import NUM_TABLES, RADIX, STEPS, code_lengths, step_code
from kvcodec.codecs.registry import register_codec
from kvcodec.errors import CorruptDataError, InvalidInputError

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


@dataclass
class _Part:
    """The side information of one part (keys or values) of a section."""

    mu: np.ndarray  # float16 [C]
    b_code: np.ndarray  # uint8 [C]
    table: np.ndarray  # uint8 [C]
    anchor_table: np.ndarray | None  # uint8 [C] when group > 1
    a_code: np.ndarray | None  # uint8 [H * T] for values


@register_codec
class CacheGen(Codec):
    """CacheGen: query-aware uniform quantization, per-channel Gaussian tables, lane-parallel ANS."""

    codec_id = "cachegen"
    lossless = False

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
        if prof is None or ctx.layer >= len(prof.key_weight):
            return None, None
        kw, vw = prof.key_weight[ctx.layer], prof.value_weight[ctx.layer]
        s = ctx.shape
        if tuple(kw.shape) != (s.heads, s.key_dim) or tuple(vw.shape) != (s.heads, s.value_dim):
            raise InvalidInputError(f"profile {prof.model!r} does not match layer {ctx.layer}'s shape")
        return kw.float(), vw.float()

    @staticmethod
    def _key_steps(x: np.ndarray, weight: torch.Tensor | None, mult: float) -> np.ndarray:
        if weight is not None:
            # equal logit error per channel: the step is inversely proportional to the query RMS on it
            return (mult / np.maximum(weight.numpy(), 1e-6)).reshape(-1)
        # Without a profile, a channel pair's own RMS stands in for the queries' (in trained models the
        # large query and key pairs coincide); the head's RMS keeps the step in the keys' units.
        energy = (x ** 2).mean(1)  # [H, D]
        half = x.shape[2] // 2
        pair = np.concatenate([(energy[:, :half] + energy[:, half:2 * half]) / 2, energy[:, 2 * half:]], 1)
        pair = np.concatenate([pair[:, :half], pair], 1) if half else pair
        head = np.sqrt(energy.mean(1, keepdims=True))
        return (FALLBACK_KEY_STEP * mult * head / np.maximum(np.sqrt(pair), 1e-6)).reshape(-1)

    @staticmethod
    def _value_steps(weight: torch.Tensor | None, mult: float, heads: int, dim: int) -> np.ndarray:
        if weight is None:
            return np.full(heads * dim, mult)
        rel = weight.mean(-1, keepdim=True) / weight.clamp_min(1e-6)
        return (mult * rel).reshape(-1).numpy()

    # --- encode -------------------------------------------------------------------------

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        kw, vw = self._weights(ctx)
        mk, mv = self._multipliers(ctx)
        k, v = _as_float32(keys), _as_float32(values)
        if not (np.isfinite(k).all() and np.isfinite(v).all()):
            raise InvalidInputError("cachegen cannot encode non-finite values (NaN or inf)")
        key_part = self._encode_part(k, self._key_steps(k, kw, mk), token_scale=False)
        value_part = self._encode_part(v, self._value_steps(vw, mv, v.shape[0], v.shape[2]), token_scale=True)
        sinks = self._sinks(ctx)
        exact = [np.ascontiguousarray(a[:, :sinks]).astype("<f2").tobytes() for a in (k, v)] if sinks else []
        return b"".join([key_part, value_part, *exact])

    def _sinks(self, ctx: LayerContext) -> int:
        """How many of this section's tokens are attention sinks, kept exactly (as float16)."""
        return max(0, min(self.sink_tokens - ctx.token_start, ctx.shape.tokens))

    def _encode_part(self, x: np.ndarray, b_target: np.ndarray, token_scale: bool) -> bytes:
        h, t, d = x.shape
        xc = np.ascontiguousarray(x.transpose(0, 2, 1)).reshape(h * d, t)  # [C, T]
        mu = xc.mean(1).astype(np.float16)
        a_code = None
        a = np.ones((h, t), np.float32)
        if token_scale:
            rms = np.sqrt((x ** 2).mean(-1))  # [H, T]
            a_code = step_code(rms).reshape(-1)
            a = STEPS[a_code].reshape(h, t)
        b_code = step_code(b_target)
        for _ in range(8):
            q, anchors = self._quantize(xc, mu, a, b_code, d)
            worst = np.maximum(np.abs(q).max(1), np.abs(anchors).max(1) if anchors is not None else 0)
            over = worst > RADIX
            if not over.any():
                break
            # a symbol out of range: coarsen that channel's step just enough
            b_code[over] = np.minimum(255, b_code[over] + np.ceil(8 * np.log2(worst[over] / RADIX)).astype(np.int64) + 1)
        else:
            raise InvalidInputError("cachegen could not fit the values into its symbol range")
        table = _choose_tables(q if anchors is None else np.delete(q, np.arange(0, t, self.group), axis=1))
        anchor_table = _choose_tables(anchors) if anchors is not None else None
        part = _Part(mu, b_code, table, anchor_table, a_code)
        return self._pack(part, q, anchors, t)

    def _quantize(self, xc: np.ndarray, mu: np.ndarray, a: np.ndarray, b_code: np.ndarray,
                  d: int) -> tuple[np.ndarray, np.ndarray | None]:
        step = _steps(a, b_code, d)
        m = mu.astype(np.float32)[:, None]
        if self.group == 1:
            return np.rint((xc - m) / step).astype(np.int64), None
        idx = np.arange(xc.shape[1])
        anchor_idx = idx[:: self.group]
        anchor_step = step[:, anchor_idx] * ANCHOR_SHRINK
        qa = np.rint((xc[:, anchor_idx] - m) / anchor_step).astype(np.int64)
        xa = m + qa.astype(np.float32) * anchor_step
        base = xa[:, idx // self.group]
        q = np.rint((xc - base) / step).astype(np.int64)
        q[:, anchor_idx] = 0
        return q, qa

    def _plan(self, channels: int, tokens: int, table: np.ndarray, anchor_table: np.ndarray | None) -> list[list[Run]]:
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
                    runs = _table_runs("q", chans, slice(t0, t1), t1 - t0, table)
                else:
                    tok = np.arange(t0, t1)
                    is_anchor = tok % self.group == 0
                    anchor_cols, delta_cols = tok[is_anchor] // self.group, tok[~is_anchor]
                    runs = (_table_runs("anchor", chans, anchor_cols, len(anchor_cols), anchor_table)
                            + _table_runs("q", chans, delta_cols, len(delta_cols), table))
                lanes.append(runs)
        return lanes

    def _pack(self, part: _Part, q: np.ndarray, anchors: np.ndarray | None, tokens: int) -> bytes:
        sources = {"q": q, "anchor": anchors}
        lanes_words, lengths = [], []
        for runs in self._plan(q.shape[0], tokens, part.table, part.anchor_table):
            words = encode_lane([(r.gather(sources[r.source]), r.table) for r in runs])
            lanes_words.append(words.astype("<u4").tobytes())
            lengths.append(len(words))
        head = [part.mu.astype("<f2").tobytes(), part.b_code.tobytes(), part.table.tobytes()]
        if part.anchor_table is not None:
            head.append(part.anchor_table.tobytes())
        if part.a_code is not None:
            head.append(part.a_code.tobytes())
        head.append(np.array(lengths, dtype="<u2").tobytes())
        return b"".join(head + lanes_words)

    # --- decode -------------------------------------------------------------------------

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        (keys, _), (values, _) = self._decode_section(data, ctx)
        return _to_tensor(keys, ctx), _to_tensor(values, ctx)

    def error_bounds(self, data: bytes, ctx: LayerContext) -> tuple[np.ndarray, np.ndarray]:
        """The largest error each decoded key and value element can have (half its step), ``[H, T, D]``,
        before rounding to the output dtype."""
        (_, kb), (_, vb) = self._decode_section(data, ctx)
        return kb, vb

    def _decode_section(self, data: bytes, ctx: LayerContext) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        s = ctx.shape
        view = memoryview(data)
        keys, pos = self._decode_part(view, 0, s.heads, s.tokens, s.key_dim, token_scale=False)
        values, pos = self._decode_part(view, pos, s.heads, s.tokens, s.value_dim, token_scale=True)
        sinks = self._sinks(ctx)
        for (x, bound), dim in ((keys, s.key_dim), (values, s.value_dim)):
            size = 2 * s.heads * sinks * dim
            if pos + size > len(data):
                raise CorruptDataError("cachegen section is truncated in its sink tokens")
            x[:, :sinks] = np.frombuffer(view[pos:pos + size], "<f2").reshape(s.heads, sinks, dim)
            bound[:, :sinks] = 0
            pos += size
        if pos != len(data):
            raise CorruptDataError(f"cachegen section has {len(data) - pos} bytes too many")
        return keys, values

    def _decode_part(self, view: memoryview, pos: int, h: int, t: int, d: int,
                     token_scale: bool) -> tuple[tuple[np.ndarray, np.ndarray], int]:
        """``((x, half step), end position)``, both ``[H, T, D]``, for the part at ``pos``."""
        c = h * d
        n_lanes = -(-c // self.lane_channels) * -(-t // self.lane_tokens)

        def take(n: int, dtype: str) -> np.ndarray:
            nonlocal pos
            size = n * np.dtype(dtype).itemsize
            if pos + size > len(view):
                raise CorruptDataError("cachegen section is truncated")
            arr = np.frombuffer(view[pos:pos + size], dtype=dtype)
            pos += size
            return arr

        mu = take(c, "<f2").astype(np.float32)
        b_code = take(c, "u1")
        table = take(c, "u1")
        anchor_table = take(c, "u1") if self.group > 1 else None
        a = STEPS[take(h * t, "u1")].reshape(h, t) if token_scale else np.ones((h, t), np.float32)
        lengths = take(n_lanes, "<u2").astype(np.int64)
        if int(table.max(initial=0)) >= NUM_TABLES or (anchor_table is not None and int(anchor_table.max(initial=0)) >= NUM_TABLES):
            raise CorruptDataError("cachegen section names a table outside the codebook")
        if not np.isfinite(mu).all():
            raise CorruptDataError("cachegen section has non-finite channel means")
        q = np.zeros((c, t), np.int64)
        qa = np.zeros((c, -(-t // self.group)), np.int64) if self.group > 1 else None
        targets = {"q": q, "anchor": qa}
        for runs, n in zip(self._plan(c, t, table, anchor_table), lengths):
            words = take(int(n), "<u4").astype(np.uint32)
            for r, symbols in zip(runs, decode_lane(words, [(r.size, r.table) for r in runs])):
                r.scatter(targets[r.source], symbols)
        step = _steps(a, b_code, d)
        m = mu[:, None]
        if qa is None:
            xc = m + q.astype(np.float32) * step
        else:
            anchor_idx = np.arange(0, t, self.group)
            xa = m + qa.astype(np.float32) * (step[:, anchor_idx] * ANCHOR_SHRINK)
            xc = xa[:, np.arange(t) // self.group] + q.astype(np.float32) * step
            xc[:, anchor_idx] = xa
            step[:, anchor_idx] *= ANCHOR_SHRINK

        def to_htd(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a.reshape(h, d, t).transpose(0, 2, 1))

        return (to_htd(xc), to_htd(step / 2)), pos


@dataclass(frozen=True)
class Run:
    """Symbols coded with one table in a lane: ``rows`` (channels) by ``cols`` (tokens, or anchor
    indices when ``source == "anchor"``) of a symbol matrix, row-major."""

    source: str
    rows: np.ndarray
    cols: slice | np.ndarray
    width: int
    table: int

    @property
    def size(self) -> int:
        return len(self.rows) * self.width

    def gather(self, matrix: np.ndarray) -> np.ndarray:
        block = matrix[self.rows, self.cols] if isinstance(self.cols, slice) else matrix[np.ix_(self.rows, self.cols)]
        return block.reshape(-1)

    def scatter(self, matrix: np.ndarray, symbols: np.ndarray) -> None:
        block = symbols.reshape(len(self.rows), self.width)
        if isinstance(self.cols, slice):
            matrix[self.rows, self.cols] = block
        else:
            matrix[np.ix_(self.rows, self.cols)] = block


def _table_runs(source: str, chans: np.ndarray, cols: slice | np.ndarray, width: int, table: np.ndarray) -> list[Run]:
    """One run per distinct table among ``chans``: its channels (in order) and the columns they code."""
    if not width:
        return []
    order = chans[np.argsort(table[chans], kind="stable")]
    cuts = np.flatnonzero(np.diff(table[order])) + 1
    return [Run(source, rows, cols, width, int(table[rows[0]])) for rows in np.split(order, cuts)]


def _steps(a: np.ndarray, b_code: np.ndarray, d: int) -> np.ndarray:
    """``step[c, t] = a[h, t] * b[c]`` in float32, channel ``c = h * d + j``."""
    b = STEPS[b_code].reshape(-1, d)  # [H, D]
    return (a[:, None, :] * b[:, :, None]).reshape(-1, a.shape[1])


def _choose_tables(q: np.ndarray) -> np.ndarray:
    """Per row of symbols, the codebook table that codes it in the fewest bits."""
    rows = q.shape[0]
    lo, hi = int(q.min(initial=0)), int(q.max(initial=0))
    width = hi - lo + 1  # only the symbols that occur need counting
    counts = np.bincount((np.arange(rows)[:, None] * width + (q - lo)).reshape(-1), minlength=rows * width)
    # einsum's own loop, not BLAS: a matrix this small is not worth waking (or waiting for) BLAS threads
    bits = np.einsum("rw,wt->rt", counts.reshape(rows, width).astype(np.float64),
                     code_lengths()[lo + RADIX:hi + RADIX + 1], optimize=False)
    return np.argmin(bits, axis=1).astype(np.uint8)


def _to_tensor(x: np.ndarray, ctx: LayerContext) -> torch.Tensor:
    # numpy casts to float16 with the same round-to-nearest-even as torch, without torch's threading overhead
    if ctx.dtype == torch.float16:
        x = x.astype(np.float16)
    return torch.from_numpy(x).to(ctx.device, ctx.dtype)


def _as_float32(x: torch.Tensor) -> np.ndarray:
    x = x.detach().cpu()
    return (x.float() if x.dtype == torch.bfloat16 else x).numpy().astype(np.float32)
