"""``lmcache-cachegen``: the CacheGen scheme as LMCache ships it, as a baseline.

Reconstructed from LMCache's description (serde ``cachegen_encoder``, ``cachegen_basics``
and its CUDA ``calculate_cdf``/arithmetic-coder kernels); the code here is our own.

* **Quantization**, per layer, keys and values separately, one scale per token:
  the channels of a token are all heads' dims together (``C = H·D``);
  ``amax[t] = max_c |x[t, c]|`` (in the cache dtype, stored as such);
  with ``M = bins // 2 − 1``, ``q = round(x · (M / amax) + M)``, a symbol in
  ``0 … 2M``; decoded as ``(q − M) / M · amax``.
* **Bins**: ``key_bins`` (32) in the first ``shallow_key_layers`` (10) layers,
  ``value_bins`` (32) in the first ``shallow_value_layers`` (2), ``deep_bins`` (16)
  in every later layer.  ``deep_bins=32`` is "32 everywhere".
* **Entropy coding**: per section (one layer × one chunk), one 16-bit CDF per
  (K/V, channel) over the section's tokens, with ``NB + 1`` entries where ``NB``
  is the largest bin count any layer of the model uses for that tensor (LMCache
  sizes the table by ``key_bins.max()``/``value_bins.max()``, so 33 entries by
  default, also for 16-bin layers), normalized like LMCache's kernel:
  ``cdf[i] = floor((65535 − NB) · cum[i] / T) + i``.  Symbols are arithmetic coded
  one stream per (K/V, channel) per 256 tokens ("lanes", as LMCache's GPU coder
  does), each stream's length stored as a u32.  The coder is constriction's range
  coder, with the 16-bit frequencies scaled exactly to its 24-bit precision.

Deviations from LMCache, all documented in spec/lmcache-cachegen.md (§10.6): a zero ``amax`` (an all-zero
token) gives symbol ``M`` (LMCache divides by zero); the coder and its stream
format are constriction's range coder (32-bit words) rather than LMCache's bitwise
arithmetic coder (bytes), so lane lengths count 32-bit words; the histogram is
exact for any token count (LMCache's uint16 counters assume ≤ 65535 tokens).
"""

from __future__ import annotations

import math
from typing import Any

import constriction
import numpy as np
import torch

from kvcodec.codecs.base import Codec, LayerContext
from kvcodec.codecs.registry import register_codec
from kvcodec.errors import CorruptDataError, InvalidInputError

LANE_TOKENS = 256  # tokens per arithmetic-coded stream (LMCache's CACHEGEN_GPU_MAX_TOKENS_PER_CHUNK)
CDF_BITS = 16
CDF_TOTAL = 1 << CDF_BITS  # the coder's total frequency for the 16-bit tables
CODER_BITS = 24  # constriction's probability precision
MIN_BINS, MAX_BINS = 4, 64
MAX_SHALLOW_LAYERS = 4096

_Categorical = constriction.stream.model.Categorical
_RangeEncoder = constriction.stream.queue.RangeEncoder
_RangeDecoder = constriction.stream.queue.RangeDecoder


def cdf_from_symbols(q: np.ndarray, nb: int) -> np.ndarray:
    """The uint16 ``[C, nb + 1]`` CDF table of symbols ``q`` ``[T, C]`` (each < nb), per channel.

    ``cdf[c, i] = floor((65535 − nb) · #{t: q[t, c] < i} / T) + i``: LMCache's normalization,
    strictly increasing from 0 to 65535.
    """
    t, c = q.shape
    counts = np.bincount((np.arange(c, dtype=np.int64)[None, :] * nb + q).reshape(-1), minlength=c * nb)
    cum = np.zeros((c, nb + 1), dtype=np.int64)
    np.cumsum(counts.reshape(c, nb), axis=1, out=cum[:, 1:])
    cdf = (CDF_TOTAL - 1 - nb) * cum // t + np.arange(nb + 1, dtype=np.int64)
    return cdf.astype(np.uint16)


def frequencies(cdf: np.ndarray) -> np.ndarray:
    """Coder frequencies (int64, ``[..., nb]``, each ≥ 1, summing to 65536) of a valid CDF table.

    Symbol ``s`` spans ``[cdf[s], cdf[s+1])``, except the last, ``s = nb − 1``, which spans
    ``[cdf[nb−1], 65536)`` as in LMCache's coder; the table's final entry (always 65535) is unused.
    """
    c = cdf.astype(np.int64)
    upper = np.concatenate([c[..., 1:-1], np.full(c.shape[:-1] + (1,), CDF_TOTAL, np.int64)], axis=-1)
    return upper - c[..., :-1]


def coder_model(freq: np.ndarray) -> Any:
    """constriction's Categorical whose 24-bit quantized table is exactly ``freq · 256``.

    constriction's fast (``perfect=False``) quantizer gives weight ``w_i`` the frequency
    ``w_i + 1`` when the weights sum to ``2**24 − n``; so ``w_i = 256·f_i − 1``.
    """
    return _Categorical((freq << (CODER_BITS - CDF_BITS)).astype(np.float64) - 1.0, perfect=False)


def _as_float32(x: torch.Tensor) -> np.ndarray:
    """``x`` widened exactly to a float32 numpy array (numpy for float16/32, torch for bfloat16)."""
    x = x.detach().cpu()
    if x.dtype in (torch.float16, torch.float32):
        return x.numpy().astype(np.float32)
    return x.float().numpy()


def _from_float32(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` rounded to ``dtype`` (nearest even; numpy and torch round alike)."""
    if dtype == torch.float16:
        return torch.from_numpy(x.astype(np.float16))
    return torch.from_numpy(x).to(dtype)


def check_cdf(cdf: np.ndarray, what: str) -> None:
    if cdf.size == 0:
        return
    if bool((cdf[:, 0] != 0).any()) or bool((cdf[:, -1] != CDF_TOTAL - 1).any()):
        raise CorruptDataError(f"lmcache-cachegen {what} CDF does not run from 0 to 65535")
    if bool((np.diff(cdf.astype(np.int64), axis=1) <= 0).any()):
        raise CorruptDataError(f"lmcache-cachegen {what} CDF is not strictly increasing")


@register_codec
class LMCacheCacheGen(Codec):
    """LMCache's CacheGen: per-token absmax quantization, 32/16 bins by layer, per-channel 16-bit CDFs,
    arithmetic coding per (K/V, channel) lane of 256 tokens."""

    codec_id = "lmcache-cachegen"
    lossless = False

    def __init__(self, key_bins: int = 32, value_bins: int = 32, deep_bins: int = 16, shallow_key_layers: int = 10,
                 shallow_value_layers: int = 2) -> None:
        for name, v in (("key_bins", key_bins), ("value_bins", value_bins), ("deep_bins", deep_bins)):
            if not (isinstance(v, int) and not isinstance(v, bool) and MIN_BINS <= v <= MAX_BINS and v % 2 == 0):
                raise InvalidInputError(f"lmcache-cachegen {name} must be an even integer in {MIN_BINS}..{MAX_BINS}, not {v!r}")
        for name, v in (("shallow_key_layers", shallow_key_layers), ("shallow_value_layers", shallow_value_layers)):
            if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_SHALLOW_LAYERS):
                raise InvalidInputError(f"lmcache-cachegen {name} must be an integer in 0..{MAX_SHALLOW_LAYERS}, not {v!r}")
        self.key_bins, self.value_bins, self.deep_bins = key_bins, value_bins, deep_bins
        self.shallow_key_layers, self.shallow_value_layers = shallow_key_layers, shallow_value_layers

    @classmethod
    def presets(cls) -> list[dict[str, Any]]:
        return [{}, {"deep_bins": 32}]  # LMCache's defaults, and its 32 bins in every layer

    def get_config(self) -> dict[str, Any]:
        return {"key_bins": self.key_bins, "value_bins": self.value_bins, "deep_bins": self.deep_bins,
                "shallow_key_layers": self.shallow_key_layers, "shallow_value_layers": self.shallow_value_layers}

    # -- layout ------------------------------------------------------------------------------------------

    def bins(self, layer: int, is_key: bool) -> int:
        """Bins used by ``layer`` for keys or values."""
        if is_key:
            return self.key_bins if layer < self.shallow_key_layers else self.deep_bins
        return self.value_bins if layer < self.shallow_value_layers else self.deep_bins

    def table_bins(self, num_layers: int, is_key: bool) -> int:
        """``NB``: the largest bin count of any layer of the model for keys or values; tables have NB + 1 entries."""
        shallow = self.shallow_key_layers if is_key else self.shallow_value_layers
        first = self.key_bins if is_key else self.value_bins
        used = ([first] if shallow > 0 else []) + ([self.deep_bins] if num_layers > shallow else [])
        return max(used)

    def fixed_size(self, ctx: LayerContext) -> int:
        """Bytes of a section before its streams: scales, CDF tables and lane lengths."""
        s = ctx.shape
        ck, cv = s.heads * s.key_dim, s.heads * s.value_dim
        lk, lv = self.table_bins(ctx.num_layers, True) + 1, self.table_bins(ctx.num_layers, False) + 1
        lanes = math.ceil(s.tokens / LANE_TOKENS) * (ck + cv)
        return 2 * s.tokens * ctx.dtype.itemsize + 2 * (ck * lk + cv * lv) + 4 * lanes

    # -- encoding ----------------------------------------------------------------------------------------

    @staticmethod
    def _quantize(x: torch.Tensor, bins: int) -> tuple[np.ndarray, np.ndarray]:
        """``[H, T, D]`` to (absmax ``[T]`` float32, exactly a value of x's dtype; symbols ``[T, H·D]`` int32)."""
        h, t, d = x.shape
        xf = _as_float32(x).transpose(1, 0, 2).reshape(t, h * d)  # exact widening
        if not bool(np.isfinite(xf).all()):
            raise InvalidInputError("lmcache-cachegen cannot quantize non-finite values (NaN or inf) in the KV cache")
        amax = np.abs(xf).max(axis=1)
        m = np.float32(bins // 2 - 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = m / amax  # binary32, inf where amax is 0
            q = np.rint(xf * factor[:, None] + m)  # two binary32 roundings, then half to even
        q[np.isnan(q)] = m  # 0·inf (an all-zero token) -> M
        return amax, np.clip(q, 0, 2 * m).astype(np.int32)

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        parts = []
        tables, coded = [], []
        for x, is_key in ((keys, True), (values, False)):
            amax, q = self._quantize(x, self.bins(ctx.layer, is_key))
            nb = self.table_bins(ctx.num_layers, is_key)
            cdf = cdf_from_symbols(q, nb)
            parts.append(torch.from_numpy(amax).to(x.dtype).view(torch.uint8).numpy().tobytes())
            tables.append(cdf.astype("<u2").tobytes())
            coded.append((q, [coder_model(f) for f in frequencies(cdf)]))
        # one stream per lane, in LMCache's order: per 256-token group, key channels then value channels
        lanes: list[np.ndarray] = []
        for g in range(0, keys.shape[1], LANE_TOKENS):
            for q, models in coded:
                block = np.ascontiguousarray(q[g:g + LANE_TOKENS].T)
                for c, model in enumerate(models):
                    enc = _RangeEncoder()
                    enc.encode(block[c], model)
                    lanes.append(enc.get_compressed())
        lengths = np.array([len(w) for w in lanes], dtype="<u4")
        words = np.concatenate(lanes).astype("<u4") if lanes else np.zeros(0, "<u4")
        return b"".join(parts + tables + [lengths.tobytes(), words.tobytes()])

    # -- decoding ----------------------------------------------------------------------------------------

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._decode(data, ctx)
        except CorruptDataError:
            raise
        except (KeyboardInterrupt, SystemExit, MemoryError):
            raise
        except BaseException as e:  # the coder rejecting a stream (also a Rust panic, a BaseException), or else
            raise CorruptDataError(f"lmcache-cachegen section does not decode: {type(e).__name__}: {e}") from e

    def _decode(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        s, e = ctx.shape, ctx.dtype.itemsize
        t = s.tokens
        ck, cv = s.heads * s.key_dim, s.heads * s.value_dim
        nbk, nbv = self.table_bins(ctx.num_layers, True), self.table_bins(ctx.num_layers, False)
        groups = math.ceil(t / LANE_TOKENS)
        fixed = self.fixed_size(ctx)
        if len(data) < fixed or (len(data) - fixed) % 4:
            raise CorruptDataError(f"lmcache-cachegen section is {len(data)} bytes; its shape needs {fixed} bytes "
                                   f"of scales, tables and lane lengths plus whole 32-bit words")
        buf = memoryview(data)
        pos = 0

        def take(n: int) -> memoryview:
            nonlocal pos
            pos += n
            return buf[pos - n:pos]

        scales = []
        for what in ("key", "value"):
            amax = torch.from_numpy(np.frombuffer(take(t * e), np.uint8).copy()).view(ctx.dtype)
            if not bool(torch.isfinite(amax).all()) or bool(torch.signbit(amax).any()):
                raise CorruptDataError(f"lmcache-cachegen {what} scales are not finite and non-negative")
            scales.append(amax.float().numpy())
        cdfs = []
        for what, c, nb in (("key", ck, nbk), ("value", cv, nbv)):
            cdf = np.frombuffer(take(2 * c * (nb + 1)), "<u2").reshape(c, nb + 1)
            check_cdf(cdf, what)
            cdfs.append(cdf)
        lengths = np.frombuffer(take(4 * groups * (ck + cv)), "<u4").astype(np.int64)
        words = np.frombuffer(buf[pos:], "<u4").astype(np.uint32)
        if int(lengths.sum()) != words.size:
            raise CorruptDataError(f"lmcache-cachegen lane lengths add up to {int(lengths.sum())} words; "
                                   f"the section holds {words.size}")
        ends = np.cumsum(lengths)
        starts = ends - lengths

        out = [np.empty((t, ck), np.int32), np.empty((t, cv), np.int32)]
        models = [[coder_model(f) for f in frequencies(cdf)] for cdf in cdfs]
        lane = 0
        for g in range(groups):
            n = min(LANE_TOKENS, t - g * LANE_TOKENS)
            for k in range(2):
                for c, model in enumerate(models[k]):
                    dec = _RangeDecoder(words[starts[lane]:ends[lane]])
                    out[k][g * LANE_TOKENS:g * LANE_TOKENS + n, c] = dec.decode(model, n)
                    if not dec.maybe_exhausted():
                        raise CorruptDataError(f"lmcache-cachegen lane {lane} has words left after its {n} symbols")
                    lane += 1

        result = []
        for k, (is_key, d) in enumerate(((True, s.key_dim), (False, s.value_dim))):
            m = self.bins(ctx.layer, is_key) // 2 - 1
            q = out[k]
            if q.size and int(q.max()) > 2 * m:
                raise CorruptDataError(f"lmcache-cachegen decoded a symbol beyond {2 * m} for {m * 2 + 2} bins")
            mf = np.float32(m)
            x = (q.astype(np.float32) - mf) / mf * scales[k][:, None]  # three binary32 roundings
            x = np.ascontiguousarray(x.reshape(t, s.heads, d).transpose(1, 0, 2))
            result.append(_from_float32(x, ctx.dtype).to(ctx.device))
        return result[0], result[1]
