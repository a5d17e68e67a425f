"""cachegen's Triton kernels on a CUDA GPU: correctness first, then encode/decode throughput.

    python bench/gpu_cachegen.py [--tokens 256,2048,8192] [--lanes 64x256,16x256,64x64] [--repeat 20]
    python bench/gpu_cachegen.py --device cpu      # a smoke run in Triton's interpreter, tiny shapes

1. Correctness on the device, on real SmolLM2 KV: the bytes the kernels make equal the CPU path's,
   decoding on the device equals the CPU decode, and decoding into paged blocks equals the contiguous
   decode.  Any mismatch is reported and the script exits 1.
2. Throughput on Llama-3-8B-shaped chunks (32 layers, 8 KV heads, head_dim 128) built by tiling real
   SmolLM2 KV, as GB/s of float16 KV (median of --repeat runs after warm-up, CUDA events), side by side:
   cachegen encode (the whole ``encode_layers`` call, host work and copies included) and decode (from
   host bytes, and the kernel alone with its inputs staged), a plain torch quantize/dequantize with no
   entropy coding, a device-to-device copy (the memory-bandwidth ceiling), and nvCOMP's ANS on the same
   symbols when ``nvidia-nvcomp-cu13`` is installed.  Peak device memory beyond input and output is
   reported for the decode.

Writes bench/results/gpu_cachegen.md (or gpu_cachegen-smoke.md for --device cpu).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
LLAMA = dict(layers=32, heads=8, dim=128)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="256,2048,8192", help="chunk sizes to time (tokens)")
    ap.add_argument("--repeat", type=int, default=20, help="timed runs per measurement (median reported)")
    ap.add_argument("--level", type=int, default=2, help="cachegen level")
    ap.add_argument("--lanes", default="64x256,16x256,64x64",
                    help="lane geometries CHANNELSxTOKENS to time (more, smaller lanes: more GPU parallelism, "
                         "about 35 bits of flush each); the first is the codec's default")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: smoke-test this script in Triton's interpreter on tiny shapes")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before anything defines the kernels

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvcodec  # noqa: E402
from kvcodec.chunking import layer_context, make_header  # noqa: E402
from kvcodec.codecs.cachegen.device import DecodeLaunch  # noqa: E402
from kvcodec.codecs.entropy.device import dense_destination  # noqa: E402
from kvcodec.container import ContainerFile  # noqa: E402
from kvcodec.layouts.paged import slot_mapping  # noqa: E402
from gpu_timing import Report, Timer, device_or_none  # noqa: E402
from real_kv import gpl3_kv  # noqa: E402


def llama_chunk(kv: kvcodec.KVCache, tokens: int, layers: int, heads: int, dim: int,
                device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A Llama-shaped chunk tiled from real KV: head pairs side by side for head_dim, heads and tokens repeated."""
    out = []
    for i in range(layers):
        src = kv.layers[i % kv.num_layers]
        pair = []
        for x in (src.keys, src.values):
            wide = torch.cat([x, x.roll(1, 0)], 2)[..., :dim] if dim > x.shape[2] else x[..., :dim]
            wide = wide.repeat(-(-heads // wide.shape[0]), -(-tokens // wide.shape[1]), 1)[:heads, :tokens]
            pair.append(wide.contiguous().to(device))
        out.append(tuple(pair))
    return out


def contexts(pairs: list[tuple[torch.Tensor, torch.Tensor]], backend: str, device: torch.device):
    """Layer contexts for a made-up shape: no model, so no profile (none would fit it)."""
    kv = kvcodec.KVCache([(k.cpu(), v.cpu()) for k, v in pairs[:1]] * len(pairs))
    header = make_header(kv, [kvcodec.get_codec("cachegen")])
    t = pairs[0][0].shape[1]
    return [layer_context(header, i, (0, t), device, backend) for i in range(len(pairs))]


def check_correctness(kv: kvcodec.KVCache, device: torch.device, say: Callable[[str], None]) -> list[str]:
    """Bytes, decoded tensors and paged restore against the CPU path on real KV; returns the failures."""
    failures = []
    tokens = 64 if device.type == "cpu" else 512
    layers = 2 if device.type == "cpu" else kv.num_layers
    small = kvcodec.KVCache([(l.keys[:, :tokens], l.values[:, :tokens]) for l in kv.layers[:layers]], model=kv.model)
    on_device = kvcodec.KVCache([(l.keys.to(device), l.values.to(device)) for l in small.layers], model=kv.model)
    lanes = dict(lane_channels=8, lane_tokens=16) if device.type == "cpu" else {}
    for level in ([2] if device.type == "cpu" else [0, 2, 4]):
        codec = kvcodec.get_codec("cachegen", level=level, **lanes)
        cpu_bytes = kvcodec.encode(small, codec, backend="cpu")
        dev_bytes = kvcodec.encode(on_device, codec, backend="triton")
        ok = cpu_bytes == dev_bytes
        say(f"- level {level}: {len(cpu_bytes)} bytes; device encode {'==' if ok else '!='} CPU encode")
        if not ok:
            failures.append(f"level {level}: device bytes differ from the CPU path's")
        a = kvcodec.decode(cpu_bytes, backend="cpu")
        b = kvcodec.decode(cpu_bytes, device=device, backend="triton")
        same = a.equal(b.to("cpu"))
        say(f"- level {level}: device decode {'==' if same else '!='} CPU decode ({small.num_elements} elements)")
        if not same:
            failures.append(f"level {level}: device decode differs from the CPU decode")
    # paged: every section of the container restored through a shuffled block table
    block_size = 16
    n_blocks = -(-tokens // block_size)
    table = torch.randperm(n_blocks + 3)[:n_blocks].to(torch.int32)
    blob = kvcodec.encode(small, kvcodec.get_codec("cachegen", **lanes), chunk_tokens=tokens // 2)
    expected = kvcodec.decode(blob, backend="cpu")
    heads, dim = small.layers[0].keys.shape[::2]
    shapes = {"flash": (2, n_blocks + 3, block_size, heads, dim), "gpu": (n_blocks + 3, heads, block_size, 2 * dim),
              "cpu": (n_blocks + 3, heads, block_size, 2 * dim)}
    for layout, shape in shapes.items():
        with kvcodec.open(blob) as r, ContainerFile(blob) as f:
            paged = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in small.layers]
            for i in range(r.num_chunks):
                frame = f.read_frame(i)
                e = frame.entry
                for layer, data in frame.sections.items():
                    lo, hi = r.header.local_range(layer, e.token_start, e.token_count)
                    ctx = layer_context(r.header, layer, (lo, hi), device, "triton")
                    r.codecs[e.variant].decode_layer_paged(data, ctx, paged[layer],
                                                           slot_mapping(table, lo, hi - lo, block_size), layout)
        same = kvcodec.KVCache.from_paged(paged, table.to(device), tokens, layout).to("cpu").equal(expected)
        say(f"- paged restore ({layout!r} layout) through a shuffled block table {'==' if same else '!='} contiguous decode")
        if not same:
            failures.append(f"paged restore ({layout!r} layout) differs from the contiguous decode")
    return failures


def torch_quant_baseline(pairs, timer: Timer) -> tuple[float, float]:
    """Per-channel uniform 8-bit quantize and dequantize in plain torch (no entropy coding)."""
    xs = [x for p in pairs for x in p]
    stats = [(x.float().mean(1, keepdim=True), x.float().std(1, keepdim=True).clamp_min(1e-6) / 16) for x in xs]

    def quant():
        return [((x.float() - m) / s).round_().clamp_(-127, 127).to(torch.int8) for x, (m, s) in zip(xs, stats)]

    codes = quant()
    outs = [torch.empty_like(x) for x in xs]

    def dequant():
        for o, q, (m, s) in zip(outs, codes, stats):
            torch.add(m, q.float() * s, out=o)  # written in float16

    return timer(quant), timer(dequant)


def nvcomp_baseline(symbols: torch.Tensor, timer: Timer) -> tuple[float, float, float] | str:
    """nvCOMP's ANS encode and decode of the same symbols (one byte each), with its bits per symbol,
    or why it could not run."""
    try:
        from nvidia import nvcomp
    except ImportError as e:
        return f"not installed ({e})"
    try:
        codec = nvcomp.Codec(algorithm="ANS")
        raw = nvcomp.as_array(symbols)
        comp = codec.encode(raw)
        back = torch.as_tensor(codec.decode(comp), device=symbols.device).reshape(-1).view(torch.uint8)
        if not torch.equal(back, symbols):
            return "round trip mismatch"
        bits = 8 * comp.buffer_size / symbols.numel()
        return timer(lambda: codec.encode(raw)), timer(lambda: codec.decode(comp)), bits
    except Exception as e:  # noqa: BLE001 - a baseline failing must not stop the report
        return f"failed: {type(e).__name__}: {e}"


def _symbols(codec, section: bytes, ctx) -> torch.Tensor:  # noqa: ANN001
    """A section's symbols (decoded on the CPU from its lanes) as bytes ``q + 128``, clamped."""
    parts, _ = codec.parse(section, ctx)
    q = np.clip(np.concatenate([codec.symbols(part)[0].reshape(-1) for part in parts]), -127, 127) + 128
    return torch.from_numpy(q.astype(np.uint8)).to(ctx.device)


def main() -> int:
    device = device_or_none(ARGS.device)
    if device is None:
        return 2
    say = Report(device, "gpu_cachegen", "cachegen on the GPU (Triton kernels)")
    kv = gpl3_kv(512)
    say("## Correctness on real SmolLM2 KV (the device against the CPU path)")
    say("")
    failures = check_correctness(kv, device, say)
    say("")
    timer = Timer(device, ARGS.repeat if device.type == "cuda" else 1)
    shape = LLAMA if device.type == "cuda" else dict(layers=2, heads=2, dim=64)
    token_list = [int(t) for t in ARGS.tokens.split(",")] if device.type == "cuda" else [32]
    geometries = [tuple(int(n) for n in g.split("x")) for g in ARGS.lanes.split(",")] if device.type == "cuda" else [(8, 8)]
    say(f"## Throughput: {shape['layers']} layers x {shape['heads']} KV heads x head_dim {shape['dim']}, "
        f"`cachegen:level={ARGS.level}`, GB/s of float16 KV (median of up to {timer.repeat} runs, at least 3, about 5 s "
        "per measurement)")
    say("")
    say("| tokens | lanes | fp16 MB | bits/elem | encode | decode (from host bytes) | decode kernel | staged MB | peak extra MB | "
        "torch quant | torch dequant | D2D copy | nvCOMP ANS enc | nvCOMP ANS dec | nvCOMP bits/symbol |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tokens, (lane_channels, lane_tokens) in ((t, g) for t in token_list for g in geometries):
        codec = kvcodec.get_codec("cachegen", level=ARGS.level, lane_channels=lane_channels, lane_tokens=lane_tokens)
        baselines = (lane_channels, lane_tokens) == geometries[0]  # once per size
        try:
            pairs = llama_chunk(kv, tokens, device=device, **shape)
            size = sum(x.numel() * 2 for p in pairs for x in p)
            gbs = lambda s: f"{size / s / 1e9:.1f}"  # noqa: E731
            ctxs = contexts(pairs, "triton", device)
            sections = codec.encode_layers(pairs, ctxs)
            bits = 8 * sum(len(s) for s in sections) / (size / 2)
            if tokens == token_list[0]:  # the big shape's bytes against the CPU path too, for every geometry
                cpu_pairs = [(k.cpu(), v.cpu()) for k, v in pairs[:2]]
                cpu_ctxs = contexts(cpu_pairs, "cpu", torch.device("cpu"))
                if codec.encode_layers(cpu_pairs, cpu_ctxs) != sections[:2]:
                    failures.append(f"{tokens} tokens, Llama shape: device bytes differ from the CPU path's")
            t_enc = timer(lambda: codec.encode_layers(pairs, ctxs))
            t_dec = timer(lambda: codec.decode_layers(sections, ctxs))
            parsed = [codec.parse(s, c) for s, c in zip(sections, ctxs)]
            parts = [p for layer_parts, _ in parsed for p in layer_parts]
            out = torch.empty(size // 2, dtype=torch.float16, device=device)
            h, t, d = parts[0].shape
            staged = out.view(len(parts), h, t, d)
            launch = DecodeLaunch(codec, parts, [dense_destination(x) for x in staged])
            # what the launch staged on the device, but the output it writes (a view of ``out``)
            staged_bytes = sum(a.numel() * a.element_size() for a in launch.args[1:]
                               if isinstance(a, torch.Tensor) and a.data_ptr() != out.data_ptr())
            t_kernel = timer(launch.run)
            decoded = [x for pair in codec.decode_layers(sections, ctxs) for x in pair]
            sink = codec.sink_tokens  # decode_layers also writes the exact sink tokens; the kernel alone does not
            if not all(torch.equal(x[:, sink:], y[:, sink:]) for x, y in zip(decoded, staged)):
                failures.append(f"{tokens} tokens: staged kernel output differs from decode_layers")
            peak = "-"
            if device.type == "cuda":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                codec.decode_layers(sections, ctxs)
                torch.cuda.synchronize()
                compressed = sum(len(s) for s in sections)
                peak = f"{(torch.cuda.max_memory_allocated() - base - size - compressed) / 1e6:.2f}"
            cells = ["", "", "", "", "", ""]
            if baselines:
                t_q, t_dq = torch_quant_baseline(pairs, timer)
                flat = torch.cat([x.reshape(-1) for p in pairs for x in p])
                dst = torch.empty_like(flat)
                t_copy = timer(lambda: dst.copy_(flat))
                # cachegen's own symbols for these tensors, one byte each (clamped to +-127 for nvCOMP's bytes)
                symbols = torch.cat([_symbols(codec, s, c) for s, c in zip(sections, ctxs)])
                nv = nvcomp_baseline(symbols, timer) if device.type == "cuda" else "cuda only"
                nv_cells = [gbs(nv[0]), gbs(nv[1]), f"{nv[2]:.3f}"] if isinstance(nv, tuple) else [nv, "", ""]
                cells = [gbs(t_q), gbs(t_dq), gbs(t_copy), *nv_cells]
                del flat, dst, symbols
            say(f"| {tokens} | {lane_channels}x{lane_tokens} | {size / 1e6:.1f} | {bits:.3f} | {gbs(t_enc)} | {gbs(t_dec)} | "
                f"{gbs(t_kernel)} | {staged_bytes / 1e6:.2f} | {peak} | {' | '.join(cells)} |")
            pairs = out = None  # free device memory before the next size
        except Exception:  # noqa: BLE001 - report and go on to the next size
            failures.append(f"{tokens} tokens, lanes {lane_channels}x{lane_tokens}: {traceback.format_exc(limit=3)}")
            say(f"| {tokens} | {lane_channels}x{lane_tokens} | failed, see below | | | | | | | | | | | | |")
    say("")
    say("Staged MB: what a decode launch holds on the device besides the lane words and the output (side information "
        "as stored, lane table, channel order, row offsets, status). Peak extra MB: device memory allocated during a "
        "whole decode_layers call beyond the float16 output and the compressed bytes.")
    return say.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
