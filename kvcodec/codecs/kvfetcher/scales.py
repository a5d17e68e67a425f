"""What a ``kvfetcher`` decoder multiplies codes by: the section's scale block, in two layouts.

* :class:`FloatScales` (section flag bit 1 clear): float16 scale and zero per key channel and per value
  token, ``x = zero + q * scale`` (kivi's min-max parameters).
* :class:`StepScales` (flag bit 1 set): one-byte step codes on cachegen's ``2**(k/8)`` grid, a float16 zero
  per key channel and a float16 mean per value channel; a value is ``mean + (q - 2**(bits-1)) * step[token]``.
  Per value token this costs one byte instead of four, which is most of the side information at 64-wide heads.
  Key frames put their columns in decreasing step-code order (ties by channel): coarse-step channels hold few
  levels, fine-step ones many, and sorted columns keep the video coder's adaptive contexts on one kind at a time
  (measured on SmolLM2: 2.47 to 2.40 bits per code, keys and values together).  The decoder derives that order from the codes.

Encoders build them from KV (:func:`minmax`, :func:`spread`); decoders parse them (:func:`parse`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcodec.codecs.entropy.tables import STEPS
from kvcodec.codecs.quantize import FP16_MAX, minmax_params, quantize
from kvcodec.codecs.raw import tensor_bytes, tensor_from_bytes
from kvcodec.errors import CorruptDataError, InvalidInputError

FLAG_STEP_CODES = 2


def _finite(x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise InvalidInputError("cannot quantize non-finite values (NaN or inf) in the KV cache")
    if float(x.abs().max()) > FP16_MAX / 2:  # so that a zero below a slice's minimum stays a finite float16
        raise InvalidInputError(f"kvfetcher's spread steps take values within ±{FP16_MAX / 2:g}")


def _round_codes(x: torch.Tensor, step: torch.Tensor, centre: int, bits: int) -> np.ndarray:
    q = (torch.round(x / step) + centre).clamp_(0, (1 << bits) - 1)
    return q.to(torch.uint8 if bits <= 8 else torch.int32).numpy()


class FloatScales:
    """float16 ``ks, kz [H, 1, Dk]`` and ``vs, vz [H, T, 1]``: ``x = zero + q * scale``."""

    flags = 0

    def __init__(self, ks: torch.Tensor, kz: torch.Tensor, vs: torch.Tensor, vz: torch.Tensor) -> None:
        self.ks, self.kz, self.vs, self.vz = ks, kz, vs, vz
        self.key_columns = None

    @staticmethod
    def size(h: int, t: int, dk: int, dv: int) -> int:
        return 4 * h * dk + 4 * h * t

    @classmethod
    def parse(cls, mv: memoryview, h: int, t: int, dk: int, dv: int) -> FloatScales:
        nk, nv = h * dk, h * t
        parts = [tensor_from_bytes(mv[o:o + 2 * n], torch.float16, shape) for o, n, shape in (
            (0, nk, (h, 1, dk)), (2 * nk, nk, (h, 1, dk)), (4 * nk, nv, (h, t, 1)), (4 * nk + 2 * nv, nv, (h, t, 1)))]
        if not all(bool(torch.isfinite(p).all()) for p in parts):
            raise CorruptDataError("kvfetcher section has non-finite scales or zeros")
        return cls(*parts)

    def to_bytes(self) -> bytes:
        return b"".join(tensor_bytes(p) for p in (self.ks, self.kz, self.vs, self.vz))

    def to(self, device: torch.device) -> FloatScales:
        return FloatScales(*(p.to(device) for p in (self.ks, self.kz, self.vs, self.vz)))

    def keys(self, q: torch.Tensor) -> torch.Tensor:
        return self.kz.float() + q.float() * self.ks.float()

    def values(self, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return self.vz[:, lo:hi].float() + q.float() * self.vs[:, lo:hi].float()


class StepScales:
    """float16 key zeros ``[H, Dk]`` and value means ``[H, Dv]``, u8 step codes for key channels ``[H, Dk]`` and
    value tokens ``[H, T]``; ``bits`` sets the value codes' centre ``2**(bits-1)``."""

    flags = FLAG_STEP_CODES

    def __init__(self, kz: torch.Tensor, vm: torch.Tensor, kc: np.ndarray, vc: np.ndarray, bits: int) -> None:
        self.kz, self.vm, self.kc, self.vc, self.bits = kz, vm, kc, vc, bits
        self.ks = torch.from_numpy(STEPS[kc])[:, None, :].to(kz.device)   # [H, 1, Dk]
        self.vs = torch.from_numpy(STEPS[vc])[:, :, None].to(kz.device)   # [H, T, 1]
        # Stable order by decreasing code: ties keep channel order, so every decoder gets the same columns.
        self.key_columns = np.argsort(-kc.reshape(-1).astype(np.int32), kind="stable")

    @staticmethod
    def size(h: int, t: int, dk: int, dv: int) -> int:
        return 2 * h * dk + 2 * h * dv + h * dk + h * t

    @classmethod
    def parse(cls, mv: memoryview, h: int, t: int, dk: int, dv: int, bits: int) -> StepScales:
        kz = tensor_from_bytes(mv[:2 * h * dk], torch.float16, (h, 1, dk))
        o = 2 * h * dk
        vm = tensor_from_bytes(mv[o:o + 2 * h * dv], torch.float16, (h, 1, dv))
        o += 2 * h * dv
        kc = np.frombuffer(mv[o:o + h * dk], np.uint8).reshape(h, dk).copy()
        vc = np.frombuffer(mv[o + h * dk:o + h * dk + h * t], np.uint8).reshape(h, t).copy()
        if not (bool(torch.isfinite(kz).all()) and bool(torch.isfinite(vm).all())):
            raise CorruptDataError("kvfetcher section has non-finite zeros or means")
        return cls(kz, vm, kc, vc, bits)

    def to_bytes(self) -> bytes:
        return b"".join([tensor_bytes(self.kz), tensor_bytes(self.vm), self.kc.tobytes(), self.vc.tobytes()])

    def to(self, device: torch.device) -> StepScales:
        return StepScales(self.kz.to(device), self.vm.to(device), self.kc, self.vc, self.bits)

    def keys(self, q: torch.Tensor) -> torch.Tensor:
        return self.kz.float() + q.float() * self.ks

    def values(self, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return self.vm.float() + (q.float() - (1 << (self.bits - 1))) * self.vs[:, lo:hi]


def parse(mv: memoryview, flags: int, h: int, t: int, dk: int, dv: int, bits: int) -> FloatScales | StepScales:
    """The scale block at the start of ``mv`` (which may run on into the stream); see :func:`size`."""
    if flags & FLAG_STEP_CODES:
        return StepScales.parse(mv, h, t, dk, dv, bits)
    return FloatScales.parse(mv, h, t, dk, dv)


def size(flags: int, h: int, t: int, dk: int, dv: int) -> int:
    return (StepScales if flags & FLAG_STEP_CODES else FloatScales).size(h, t, dk, dv)


# ------------------------------------------------------------------------------------------ encoder choices

def minmax(k: torch.Tensor, v: torch.Tensor, bits: int) -> tuple[np.ndarray, np.ndarray, FloatScales]:
    """Min-max codes (kivi's parameters: keys per channel, values per token)."""
    ks, kz = minmax_params(k, 1, bits)
    vs, vz = minmax_params(v, 2, bits)
    return quantize(k, ks, kz, bits).numpy(), quantize(v, vs, vz, bits).numpy(), FloatScales(ks, kz, vs, vz)


def _step_codes(target: torch.Tensor, floor: torch.Tensor) -> np.ndarray:
    """The grid step nearest ``target`` (in log terms), raised to the first one ``>= floor``."""
    grid = STEPS.astype(np.float64)
    t = np.log2(np.maximum(target.numpy(), grid[0]))
    nearest = np.clip(np.rint(t * 8) + 128, 0, 255)
    least = np.searchsorted(grid, floor.numpy(), side="left")
    if int(least.max(initial=0)) > 255:
        raise InvalidInputError("KV values too spread for kvfetcher's step grid")
    return np.maximum(nearest, least).astype(np.uint8)


def spread(k: torch.Tensor, v: torch.Tensor, bits: int, key_target: torch.Tensor | None,
           value_spread: float, exact: int = 0) -> tuple[np.ndarray, np.ndarray, StepScales]:
    """Codes with steps set by what their error costs (see the codec's docstring); ``k``, ``v`` float32
    ``[H, T, D]``; ``key_target [H, Dk]`` the wanted key steps, or None for min-max key steps.  The first
    ``exact`` tokens (stored exactly by the caller) are left out of every statistic and get the centre code."""
    _finite(k), _finite(v)
    top, half = (1 << bits) - 1, 1 << (bits - 1)
    k64, v64 = k[:, exact:].double(), v.double()
    lo, hi, mu = k64.amin(1), k64.amax(1), k64.mean(1)                       # [H, Dk]
    floor = (hi - lo) / top * (1 + 2.0 ** -9)  # a hair over: the float16 zero may sit a little off
    kc = _step_codes(floor if key_target is None else key_target.double(), floor)
    ks = torch.from_numpy(STEPS[kc].astype(np.float64))
    kz = torch.minimum(torch.maximum(mu - half * ks, hi - top * ks), lo).to(torch.float16)[:, None, :]
    vm = v64[:, exact:].mean(1, keepdim=True).to(torch.float16)                # [H, 1, Dv]
    dev = v64 - vm.double()
    floor = torch.maximum(dev.amax(2) / (half - 0.5), -dev.amin(2) / (half + 0.5)) * (1 + 2.0 ** -9)
    vc = _step_codes(value_spread * dev.square().mean(2).sqrt(), floor)       # [H, T]
    vc[:, :exact] = 0
    sc = StepScales(kz, vm, kc, vc, bits)
    kq = _round_codes(k.double() - kz.double(), sc.ks.double(), 0, bits)
    vq = _round_codes(dev, sc.vs.double(), half, bits)
    kq[:, :exact] = vq[:, :exact] = half
    return kq, vq, sc
