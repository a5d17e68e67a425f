"""Compile cachegen's Triton kernels for NVIDIA GPUs ahead of time, with no GPU present.

Run as a script (tests/test_cachegen_triton.py does, in a process without TRITON_INTERPRET): the
interpreter accepts code that the GPU compiler rejects, so this is the CPU-side check that the kernels
lower to PTX and assemble with the ptxas bundled in the triton wheel.  It also checks the numerics the
format relies on: binary64 division correctly rounded, conversions rounded to nearest even.
Prints one line per kernel and exits 1 on any failure.
"""

from __future__ import annotations

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcodec.kernels import cachegen as K

ENCODE_TABLES = dict(x_ptr="*fp16", parts_ptr="*i64")
SIDE = dict(mu_ptr="*fp16", b_ptr="*u8", a_ptr="*u8", steps_ptr="*fp32")
# signature, constexprs, warps: as kvcodec/codecs/cachegen/device.py launches them (head_dim 128)
KERNELS = {
    "stats_kernel": (dict(**ENCODE_TABLES, sum_ptr="*fp64", abs_ptr="*fp64", tok_ptr="*fp64"),
                     dict(BLOCK_T=64, BLOCK_D=128), 4),
    "range_kernel": (dict(**ENCODE_TABLES, **SIDE, lengths_ptr="*i32", maxq_ptr="*i32", table_ptr="*u8"),
                     dict(BLOCK_T=64), 4),
    "encode_kernel": (dict(**ENCODE_TABLES, lanes_ptr="*i64", order_ptr="*i32", table_ptr="*u8", freq_ptr="*i32",
                           cum_ptr="*i32", **SIDE, scratch_ptr="*u32", nwords_ptr="*i64", num_lanes="i32",
                           max_symbols="i32", capacity="i32"), dict(BLOCK_L=32), 1),
    "compact_kernel": (dict(scratch_ptr="*u32", nwords_ptr="*i64", offsets_ptr="*i64", out_ptr="*u32", capacity="i32"),
                       dict(BLOCK=256), 4),
}
for out in ("fp16", "bf16", "fp32"):
    KERNELS[f"decode_kernel:{out}"] = (
        dict(words_ptr="*u32", lanes_ptr="*i64", lane_words_ptr="*i64", parts_ptr="*i64", order_ptr="*i32",
             table_ptr="*u8", cum_ptr="*i32", lut_ptr="*i16", **SIDE, rows_ptr="*i64", out_ptr=f"*{out}", status_ptr="*i32",
             num_lanes="i32", max_symbols="i32"), dict(BLOCK_L=32), 1)

# rounding the format depends on (spec/cachegen.md §10.3): a correctly rounded binary64 division, the +-1.5 * 2**52
# round-to-integer pair left unfolded, conversions to nearest even
ROUNDER = ["0d4338000000000000", "0dC338000000000000"]
REQUIRED = {"encode_kernel": ["div.rn.f64", *ROUNDER], "range_kernel": ["div.rn.f64", *ROUNDER],
            "decode_kernel:fp16": ["cvt.rn.f32.f64", "cvt.rn.f16.f32"]}


def main() -> int:
    failed = 0
    for arch in (80, 90):
        for name, (signature, constexprs, warps) in KERNELS.items():
            fn = getattr(K, name.split(":")[0])
            for key, value in constexprs.items():
                signature[key] = "constexpr"
            try:
                compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
                ptx = compiled.asm["ptx"]
                missing = [op for op in REQUIRED.get(name, [])
                           if not re.search(re.escape(op) + r"(?![0-9A-Fa-f.])", ptx)]
                if missing:
                    raise AssertionError(f"PTX lacks {missing}")
                print(f"sm_{arch} {name}: ok, {len(compiled.asm['cubin'])} bytes of cubin")
            except Exception as e:  # noqa: BLE001 - report every kernel
                failed += 1
                print(f"sm_{arch} {name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
