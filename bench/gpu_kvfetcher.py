"""kvfetcher on a GPU with NVDEC: decoder caps, PyNvVideoCodec decoding of PyAV-made streams bit-exact against
PyAV, NVDEC decode + restoration into paged blocks (time, peak extra memory).  Self-checking: exits 1 on any
mismatch.  Writes bench/results/gpu_kvfetcher.md.  Needs torch with CUDA, PyNvVideoCodec 2.x and PyAV.

    python bench/gpu_kvfetcher.py [--layers 8] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

import kvcodec
from kvcodec.chunking import layer_context, make_header
from kvcodec.codecs.kvfetcher.codec import KVFetcher
from kvcodec.codecs.kvfetcher.restore import restore_paged
from kvcodec.codecs.kvfetcher.section import SectionHead, decode_codes
from real_kv import FOLDER

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "gpu_kvfetcher.md"


def load_kv(tokens: int, layers: int) -> tuple[kvcodec.KVCache, str]:
    """The benches' real SmolLM2 KV (``real_kv``: the GPU machine cannot make it, so it is carried) tiled to
    ``tokens``; else, when none was carried, a synthetic random-walk cache, said so in the table."""
    dumps = sorted(FOLDER.glob("license-GPL-3-*-float16-*.safetensors")) if FOLDER.exists() else []
    if dumps:
        kv = kvcodec.KVCache.load_safetensors(dumps[-1])
        reps = -(-tokens // kv.num_tokens)
        lay = [(k.repeat(1, reps, 1)[:, :tokens], v.repeat(1, reps, 1)[:, :tokens]) for k, v in kv.layers[:layers]]
        return kvcodec.KVCache(lay, model=kv.model), f"real SmolLM2 KV ({dumps[-1].name}), tiled to {tokens} tokens"
    g = torch.Generator().manual_seed(0)
    lay = []
    for _ in range(layers):
        k = torch.randn(3, tokens, 64, generator=g).cumsum(1) * 0.05 + torch.randn(3, 1, 64, generator=g) * 3
        v = torch.randn(3, tokens, 64, generator=g)
        lay.append((k.half(), v.half()))
    return kvcodec.KVCache(lay), f"SYNTHETIC KV (no real dump found), {tokens} tokens"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    lines, failures = ["# kvfetcher on NVDEC", ""], []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    from kvcodec.codecs.kvfetcher import nvdec

    import PyNvVideoCodec as nvc  # noqa: N813
    say(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, PyNvVideoCodec {getattr(nvc, '__version__', '?')}")
    say("")
    say("## Decoder capabilities (HEVC 4:2:0)")
    say("")
    for bits in (8, 10):
        try:
            say(f"- {bits}-bit: {nvdec.decoder_caps(0, bits)}")
        except Exception as e:  # report, don't stop: the decode checks below are what matter
            say(f"- {bits}-bit: caps query failed: {type(e).__name__}: {e}")
    kv, what = load_kv(args.tokens, args.layers)
    say("")
    say(f"Data: {what}, {kv.num_layers} layers.")
    say("")
    say("## Bit-exact: NVDEC codes vs PyAV codes (each stream fed to NVDEC in 4 KiB pieces)")
    say("")
    say("| bits | scale | frame rows | sections | frames | bit-exact, kept session | bit-exact, new session | stream bytes |")
    say("|---|---|---|---|---|---|---|---|")
    # spread sections also carry exact sink tokens and permuted key columns
    configs = [(4, "spread", 256), (4, "minmax", 256), (4, "minmax", 1024), (8, "minmax", 128), (10, "minmax", 256)]
    encoded = {}
    for bits, scale, rows in configs:
        codec = KVFetcher(bits=bits, frame_tokens=rows, scale=scale)
        header = make_header(kv, [codec], 1024)
        secs, ok, ok_new, frames, nbytes = [], True, True, 0, 0
        for li in range(kv.num_layers):
            k, v = kv.layers[li]
            for c0 in range(0, kv.num_tokens, 1024):
                ctx = layer_context(header, li, (c0, min(c0 + 1024, kv.num_tokens)), torch.device("cpu"))
                data = codec.encode_layer(k[:, ctx.token_start:ctx.token_start + ctx.shape.tokens],
                                          v[:, ctx.token_start:ctx.token_start + ctx.shape.tokens], ctx)
                secs.append((li, ctx, data))
                head = SectionHead(data, ctx)
                stream = bytes(head.stream)
                ref = decode_codes(data, ctx)
                ok &= _same_codes(nvdec, ref, data, ctx, stream, reuse=True)
                ok_new &= _same_codes(nvdec, ref, data, ctx, stream, reuse=False)
                frames += head.geo.num_frames
                nbytes += len(stream)
        encoded[(bits, scale, rows)] = (header, secs)
        say(f"| {bits} | {scale} | {rows} | {len(secs)} | {frames} | {'yes' if ok else 'NO'} | "
            f"{'yes' if ok_new else 'NO'} | {nbytes} |")
        if not (ok and ok_new):
            failures.append(f"bits={bits} {scale} rows={rows}: NVDEC codes differ from PyAV")
    say("")
    say("## NVDEC decode + restoration into paged blocks (block size 16, scattered block table)")
    say("")
    say("| bits | scale | frame rows | KV MB (fp16) | NVDEC+restore s, new session per section | kept session s | "
        "kept MB/s | PyAV+restore (CPU) s | equal to CPU | peak extra torch MB | device free-memory drop MB |")
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    for (bits, scale, rows), (header, secs) in encoded.items():
        blocks = -(-kv.num_tokens // 16)
        table = torch.randperm(blocks + 16)[:blocks].int()
        paged_gpu = [torch.zeros(2, blocks + 16, 16, 3, 64, dtype=torch.float16, device=dev) for _ in range(kv.num_layers)]
        paged_cpu = [torch.zeros(2, blocks + 16, 16, 3, 64, dtype=torch.float16) for _ in range(kv.num_layers)]
        t = time.perf_counter()
        for li, ctx, data in secs:
            restore_paged(data, ctx, paged_cpu[li], table)
        cpu_s = time.perf_counter() - t
        table_gpu = table.to(dev)
        # warm-up: one section (decoder creation, CUDA kernels; leaves a kept session)
        li, ctx, data = secs[0]
        _restore_gpu(nvdec, data, ctx, paged_gpu[li], table_gpu, dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for li, ctx, data in secs:
            _restore_gpu(nvdec, data, ctx, paged_gpu[li], table_gpu, dev, reuse=False)
        torch.cuda.synchronize()
        new_s = time.perf_counter() - t
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        free0 = torch.cuda.mem_get_info()[0]
        min_free = free0
        t = time.perf_counter()
        for li, ctx, data in secs:
            _restore_gpu(nvdec, data, ctx, paged_gpu[li], table_gpu, dev)
            min_free = min(min_free, torch.cuda.mem_get_info()[0])
        torch.cuda.synchronize()
        gpu_s = time.perf_counter() - t
        peak = (torch.cuda.max_memory_allocated() - base) / 1e6
        same = all(torch.equal(a.cpu(), b) for a, b in zip(paged_gpu, paged_cpu))
        if not same:
            failures.append(f"bits={bits} {scale} rows={rows}: NVDEC restoration differs from the CPU restoration")
        mb = kv.num_elements * 2 / 1e6
        say(f"| {bits} | {scale} | {rows} | {mb:.1f} | {new_s:.3f} | {gpu_s:.3f} | {mb / gpu_s:.1f} | {cpu_s:.3f} | "
            f"{'yes' if same else 'NO'} | {peak:.2f} | {(free0 - min_free) / 1e6:.1f} |")
    say("")
    say("Each section is one elementary stream. 'New session' creates an NVDEC decoder per section; 'kept session' "
        "(the default) decodes the next stream of the same geometry through a finished decoder. The host-side digest "
        "check is off (`check=False`); bit-exactness is checked separately above.")
    say("")
    say("Result: " + ("all checks passed" if not failures else "FAILED: " + "; ".join(failures)))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


def _same_codes(nvdec, ref, data, ctx, stream, reuse) -> bool:  # noqa: ANN001
    try:
        got = nvdec.decode_codes_nvdec(data, ctx, pieces=[stream[i:i + 4096] for i in range(0, len(stream), 4096)],
                                       reuse=reuse)
    except Exception:
        traceback.print_exc()
        return False
    return np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1])


def _restore_gpu(nvdec, data, ctx, paged, table, dev, reuse=True) -> None:  # noqa: ANN001
    from dataclasses import replace

    from kvcodec.layouts.paged import slot_mapping

    flat = paged.view(2, -1, *paged.shape[3:])
    start = ctx.token_start

    def sink(lo, hi, k, v):  # noqa: ANN001
        slots = slot_mapping(table, start + lo, hi - lo, paged.shape[2])
        x = k if k is not None else v
        flat[0 if k is not None else 1, slots] = x.transpose(0, 1).to(paged.dtype)

    nvdec.restore_nvdec(data, replace(ctx, device=dev), sink, check=False, reuse=reuse)


if __name__ == "__main__":
    sys.exit(main())
