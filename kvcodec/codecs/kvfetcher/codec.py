"""``kvfetcher``: KV as lossless HEVC video (KVFetcher, arXiv 2602.09725), decodable by FFmpeg and NVDEC.

Section layout (little-endian; spec/kvfetcher.md (§10.7) spells it out):

* a 28-byte head ``<4sBBHHHHIQH``: magic ``KVF1``, bits, flags (bit 0: token delta, bit 1: step codes),
  frame rows (tokens per frame), picture rows, picture cols, frame count, stream
  length, xxh3-64 of the quantized codes (keys then values, int32 little-endian), exact tokens ``S``;
* the scale block (:mod:`.scales`): float16 scales and zeros, or one-byte step codes with float16 zeros/means;
* the first ``S`` tokens exactly, float16 keys ``[H, S, Dk]`` then values ``[H, S, Dv]``;
* the HEVC elementary stream: frames K0, V0, K1, V1, ... (block ``b`` = tokens
  ``[b*frame_rows, (b+1)*frame_rows)``), one closed GOP starting with a keyframe.

How the encoder picks the steps (config ``scale``; the decoder only reads the scale block):

* ``minmax`` (kivi's): each slice's codes span its minimum to maximum, so real KV uses all
  ``2**bits`` levels and the lossless video coder needs about ``bits`` bits per code.
* ``spread``: steps set by what the error costs, codes centred at ``2**(bits-1)``,
  so most codes sit on a few levels near the centre and the video coder needs far fewer bits.  A key
  channel's step is ``key_step / w`` with ``w`` the RMS of the queries that read it (the model's profile,
  :mod:`kvcodec.profiles`; the attention-logit error per channel is then even), centred on the channel's
  mean; a token's value step is ``value_spread`` times the RMS of its values' deviations from their channel
  means, on which its codes centre.  Steps are on cachegen's ``2**(1/8)`` grid, stored as one byte, and never
  so small that a code clips.  Without a profile for the cache's model, key steps are min-max's.  The
  sequence's first token (the attention sink, far from every mean) is stored exactly, as cachegen does,
  and left out of the statistics; its codes are the centre code.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from kvcodec.codecs.base import Codec, LayerContext
from kvcodec.codecs.kvfetcher import pictures as P
from kvcodec.codecs.kvfetcher import scales as S
from kvcodec.codecs.kvfetcher import video
from kvcodec.codecs.kvfetcher.restore import restore_on, scatter_frames, uses_nvdec
from kvcodec.codecs.kvfetcher.section import FLAG_DELTA, HEAD, MAGIC, codes_digest, decode_codes
from kvcodec.codecs.raw import tensor_bytes
from kvcodec.codecs.registry import register_codec
from kvcodec.errors import CorruptDataError, InvalidInputError
from kvcodec.threads import section_pool, torch_threads

SCALES = ("minmax", "spread")
# Measured on SmolLM2 (bench/results/kvfetcher.md): 2.61 bits/element, perplexity +0.68%.
DEFAULT_KEY_STEP = 2.0  # attention-logit units (per query RMS)
DEFAULT_VALUE_SPREAD = 1.0  # RMS deviations of the token's values from their channel means
MAX_STEP = 64.0
SINK_TOKENS = 1  # spread keeps the sequence's first token exactly, as cachegen's default does
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")


@register_codec
class KVFetcher(Codec):
    """KVFetcher: quantized KV codes as lossless HEVC video frames, decoded by FFmpeg or NVDEC.

    ``bits`` 2..10 (8-bit Main up to 8, Main10 above),
    ``frame_tokens`` token rows per frame (multiple of 16), x265 ``preset``, ``delta`` token delta along rows,
    ``scale`` ``spread`` (default, with ``key_step`` and ``value_spread``) or ``minmax`` (both None); see the
    module's docstring."""

    codec_id = "kvfetcher"
    lossless = False
    uses_profile = True
    # "auto" decodes with NVDEC onto a CUDA device when PyNvVideoCodec is there (bit-exact against FFmpeg on an
    # H200, bench/results/gpu_kvfetcher.md), else with FFmpeg
    backends = ("cpu", "nvdec")

    def __init__(self, bits: int = 4, frame_tokens: int = 256, preset: str = "ultrafast", delta: bool = False,
                 scale: str = "spread", key_step: float | None = None, value_spread: float | None = None) -> None:
        if not (isinstance(bits, int) and not isinstance(bits, bool) and 2 <= bits <= 10):
            raise InvalidInputError(f"kvfetcher bits must be an integer in 2..10, not {bits!r}")
        if not (isinstance(frame_tokens, int) and frame_tokens % P.PAGE == 0 and P.PAGE <= frame_tokens <= video.MAX_SIDE):
            raise InvalidInputError(f"kvfetcher frame_tokens must be a multiple of {P.PAGE} in {P.PAGE}..{video.MAX_SIDE}, "
                                    f"not {frame_tokens!r}")
        if preset not in PRESETS:
            raise InvalidInputError(f"kvfetcher preset must be one of {PRESETS}, not {preset!r}")
        if not isinstance(delta, bool):
            raise InvalidInputError(f"kvfetcher delta must be true or false, not {delta!r}")
        if not isinstance(scale, str) or scale not in SCALES:
            raise InvalidInputError(f"kvfetcher scale must be one of {SCALES}, not {scale!r}")
        steps = {"key_step": key_step, "value_spread": value_spread}
        if scale == "minmax":
            for name, val in steps.items():
                if val is not None:
                    raise InvalidInputError(f"kvfetcher {name} only applies to scale='spread'")
        else:
            steps = {"key_step": DEFAULT_KEY_STEP if key_step is None else key_step,
                     "value_spread": DEFAULT_VALUE_SPREAD if value_spread is None else value_spread}
            for name, val in steps.items():
                if not (isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val)
                        and 0 < val <= MAX_STEP):
                    raise InvalidInputError(f"kvfetcher {name} must be a number in (0, {MAX_STEP}], not {val!r}")
            steps = {k: float(v) for k, v in steps.items()}
        self.bits, self.frame_tokens, self.preset, self.delta = bits, frame_tokens, preset, delta
        self.scale, self.key_step, self.value_spread = scale, steps["key_step"], steps["value_spread"]

    def get_config(self) -> dict[str, Any]:
        config = {"bits": self.bits, "frame_tokens": self.frame_tokens, "preset": self.preset, "delta": self.delta}
        if self.scale != "minmax":  # min-max configs keep the four keys they had before `scale` existed
            config.update(scale=self.scale, key_step=self.key_step, value_spread=self.value_spread)
        return config

    @classmethod
    def from_file_config(cls, config: dict[str, Any]) -> KVFetcher:
        # min-max configs have no `scale` key: they were written when min-max was the only (and default) scale
        return cls.from_config(config if "scale" in config else {**config, "scale": "minmax"})

    @classmethod
    def presets(cls) -> list[dict[str, Any]]:
        return [{"key_step": ks, "value_spread": vs} for ks, vs in ((3.0, 1.5), (2.5, 1.2), (2.0, 1.0), (1.75, 0.85), (1.5, 0.7))]

    # ---------------------------------------------------------------------------------------- encode

    def quantize(self, keys: torch.Tensor, values: torch.Tensor,
                 ctx: LayerContext | None = None) -> tuple[np.ndarray, np.ndarray, S.FloatScales | S.StepScales]:
        """Codes ``[H, T, D]`` and the scale block; ``ctx`` (model and layer) finds the profile."""
        k, v = keys.detach().float().cpu(), values.detach().float().cpu()
        if self.scale == "minmax":
            return S.minmax(k, v, self.bits)
        w = self._key_weight(ctx, k.shape)
        target = None if w is None else self.key_step / w.double().clamp(min=1e-6)
        return S.spread(k, v, self.bits, target, self.value_spread, self._exact_tokens(ctx, k.shape[1]))

    def _exact_tokens(self, ctx: LayerContext | None, tokens: int) -> int:
        """How many of the section's first tokens are the sequence's sink, kept exactly (spread only; a
        section of the sink alone is quantized, as there is nothing left to take statistics from)."""
        start = ctx.token_start if ctx is not None else 0
        return max(0, min(SINK_TOKENS - start, tokens - 1)) if self.scale == "spread" else 0

    @staticmethod
    def _key_weight(ctx: LayerContext | None, shape: torch.Size) -> torch.Tensor | None:
        """The profile's query RMS ``[H, Dk]`` for this layer, or None without a profile for the model."""
        from kvcodec.profiles import find_profile

        prof = find_profile(ctx.model) if ctx is not None else None
        if prof is None:
            return None
        weights = prof.layer_weights(ctx.layer, ctx.shape)
        if weights is None or tuple(weights[0].shape) != (shape[0], shape[2]):
            raise InvalidInputError(f"profile {prof.model!r} does not match layer {ctx.layer}'s shape")
        return weights[0]

    def encode_layer(self, keys: torch.Tensor, values: torch.Tensor, ctx: LayerContext) -> bytes:
        h, t, dk = keys.shape
        dv = values.shape[2]
        geo = P.geometry(t, h, dk, dv, self.frame_tokens)
        kq, vq, sc = self.quantize(keys, values, ctx)
        n = self._exact_tokens(ctx, t)
        exact = [tensor_bytes(x[:, :n].detach().cpu().to(torch.float16)) for x in (keys, values)]
        frames = []
        for b in range(geo.blocks):
            lo, hi = geo.block(b)
            frames.append(P.to_frame(kq[:, lo:hi], geo, self.bits, self.delta, sc.key_columns))
            frames.append(P.to_frame(vq[:, lo:hi], geo, self.bits, self.delta))
        stream = video.encode_frames(frames, self.bits, self.preset)
        head = HEAD.pack(MAGIC, self.bits, (FLAG_DELTA if self.delta else 0) | sc.flags, geo.frame_rows, geo.rows,
                         geo.cols, geo.num_frames, len(stream), codes_digest(kq, vq, geo), n)
        return b"".join([head, sc.to_bytes(), *exact, stream])

    def encode_layers(self, layers: list[tuple[torch.Tensor, torch.Tensor]], ctxs: list[LayerContext]) -> list[bytes]:
        return _in_threads(lambda i: self.encode_layer(*layers[i], ctxs[i]), ctxs)

    # ---------------------------------------------------------------------------------------- decode

    def decode_layers(self, datas: list[bytes], ctxs: list[LayerContext]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if any(uses_nvdec(ctx) for ctx in ctxs):  # one NVDEC engine: sections in turn
            return super().decode_layers(datas, ctxs)
        return _in_threads(lambda i: self.decode_layer(datas[i], ctxs[i]), ctxs)

    def decode_layer(self, data: bytes, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        s = ctx.shape
        out: list[torch.Tensor] = []

        def sink(lo: int, hi: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
            if not out:  # allocated once the head, the scales and a first picture have passed their checks
                out.extend(torch.empty(s.heads, s.tokens, d, dtype=ctx.dtype, device=ctx.device)
                           for d in (s.key_dim, s.value_dim))
            if k is not None:
                out[0][:, lo:hi] = k.to(ctx.device, ctx.dtype)
            if v is not None:
                out[1][:, lo:hi] = v.to(ctx.device, ctx.dtype)

        restore_on(data, ctx, sink)
        if not out:
            raise CorruptDataError("kvfetcher section decoded to no pictures")
        return out[0], out[1]

    def decode_layer_paged(self, data: bytes, ctx: LayerContext, paged: torch.Tensor, slots: torch.Tensor,
                           layout: Any = "flash") -> None:
        """Frame by frame into the paged blocks: one frame's values are held at a time, whatever the section's length."""
        scatter_frames(data, ctx, paged, slots, layout=layout)

    def decode_codes(self, data: bytes, ctx: LayerContext) -> tuple[np.ndarray, np.ndarray]:
        """The quantized codes ``[H, T, Dk]``, ``[H, T, Dv]`` (int32) of a section, checked against its digest."""
        return decode_codes(data, ctx)


def _in_threads(fn: Callable[[int], Any], ctxs: list[LayerContext]) -> list[Any]:
    """``[fn(0), ..., fn(n-1)]`` for the ``n`` sections of ``ctxs``, on up to their call's ``threads`` threads (see
    :mod:`kvcodec.threads`): x265 and FFmpeg work without the GIL, and each section is its own stream, so a chunk's
    layers code in parallel (the bytes do not depend on it).  Each worker runs torch on one thread, so that the
    workers do not each fan out again."""
    n = len(ctxs)
    workers = min(n, ctxs[0].threads) if ctxs else 0
    if workers <= 1:
        return [fn(i) for i in range(n)]

    def one_thread(i: int) -> Any:
        with torch_threads(1):
            return fn(i)

    with section_pool(workers) as pool:
        return list(pool.map(one_thread, range(n)))
