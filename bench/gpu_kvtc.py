"""kvtc's device decode (kvcodec/codecs/kvtc/gpu.py) on a CUDA GPU: correctness first, then decode throughput
beside cachegen's on the same chunks.

    python bench/gpu_kvtc.py [--tokens 256,2048] [--group-layers 4] [--lanes 64x256,16x64] [--repeat 20]
    python bench/gpu_kvtc.py --device cpu      # a smoke run in Triton's interpreter, tiny shapes

1. Correctness on the device, on real SmolLM2 KV with its real calibration (kvcodec/formats/golden: 4 layers, 40 tokens):
   the kernel's lanes equal the CPU lane decode bit for bit, the device decode is within spec/kvtc.md's decoding
   tolerance of the CPU decode with the sink tokens exact, and decoding into paged blocks of each layout through a
   shuffled block table gives the same.  Any failure is reported and the script exits 1.
2. Throughput on Llama-3-8B-shaped chunks (32 layers, 8 KV heads, head_dim 128, RoPE theta 5e5, float16) with a
   synthetic calibration of that shape: per group of ``--group-layers`` layers a random orthonormal basis with a
   power-law spectrum set so level 2 codes at about SmolLM2's rate; the chunk is drawn from the same distribution
   (so the rate is in-distribution, not a claim about a real 8B model).  GB/s of float16 KV (median of --repeat runs
   after warm-up, CUDA events), side by side: kvtc decode from the section's host bytes into fresh tensors and into
   a paged (flash) layer per layer, the lane kernel alone with its inputs staged, the CPU decode (one run), and
   cachegen's device decode and kernel on the same chunk, and a device-to-device copy (the memory ceiling).

Writes bench/results/gpu_kvtc.md (or gpu_kvtc-smoke.md for --device cpu).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
LLAMA = dict(layers=32, heads=8, dim=128, theta=500000.0)
# variance of component i (from 1) of a group's basis: SCALE * i ** -ALPHA (keys, values), in the weighted units
# the levels' steps are in; chosen so level 2 codes this synthetic data at about SmolLM2's 0.5-0.6 bits/element
SPECTRUM = {"keys": (40.0, 1.1), "values": (300.0, 1.1)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="256,2048", help="chunk sizes to time (tokens)")
    ap.add_argument("--group-layers", default="4", help="layers per calibration group (a basis per group)")
    ap.add_argument("--lanes", default="64x256,16x64",
                    help="lane geometries COMPONENTSxTOKENS (the first is the codec's default)")
    ap.add_argument("--level", type=int, default=2, help="kvtc and cachegen level")
    ap.add_argument("--repeat", type=int, default=20, help="timed runs per measurement (median reported)")
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
from kvcodec.codecs.kvtc import KVTC, Calibration, gpu, register_calibration  # noqa: E402
from kvcodec.codecs.kvtc.calibration import GroupBasis, LayerInfo  # noqa: E402
from kvcodec.positions import Rotary  # noqa: E402
from kvcodec.container import ContainerFile  # noqa: E402
from kvcodec.layouts.paged import empty_shape, read_paged, slot_mapping  # noqa: E402
from gpu_timing import Report, Timer, device_or_none  # noqa: E402

from kvcodec.tools.kvtc_tolerance import assert_within_kvtc_tolerance  # noqa: E402  (as the tests check it)

GOLDEN = ROOT / "kvcodec" / "formats" / "golden"


def frame_of(blob: bytes, device: torch.device, backend: str):
    """Per frame of a kvtc container: its codec, joint section and its layers' contexts on ``device``."""
    with kvcodec.open(blob) as r, ContainerFile(blob) as f:
        for i in range(r.num_chunks):
            frame = f.read_frame(i)
            e = frame.entry
            ctxs = [layer_context(r.header, l, r.header.local_range(l, e.token_start, e.token_count), device, backend)
                    for l in sorted(frame.sections)]
            yield r.codecs[e.variant], frame.sections[min(frame.sections)], ctxs


def staged_lanes(codec: KVTC, section: bytes, ctxs, device: torch.device):
    """The frame's parts and their lane decode staged on ``device``."""
    parts = [p for g, present, block in codec.group_blocks(section, ctxs, {c.layer for c in ctxs})
             for p in codec.parse_group(g, present, block)[0]]
    return parts, gpu.CoefficientLaunch(codec, parts, device)


def check_correctness(device: torch.device, say: Callable[[str], None]) -> list[str]:
    failures = []
    cal = register_calibration(Calibration.from_bytes((GOLDEN / "kvtc-calibration.kvtc").read_bytes()))
    kv = kvcodec.decode((GOLDEN / "raw-f16.kvc").read_bytes())
    small = device.type == "cpu"
    lanes = dict(lane_components=8, lane_tokens=8) if small else {}
    for level in ([2] if small else [0, 2, 4]):
        blob = kvcodec.encode(kv, KVTC(level=level, calibration=cal, **lanes), chunk_tokens=24)
        exact = total = 0
        for codec, section, ctxs in frame_of(blob, device, "triton"):
            parts, launch = staged_lanes(codec, section, ctxs, device)
            launch.run()
            for part, got in zip(parts, launch.coefficients):
                total += 1
                exact += torch.equal(got.cpu(), codec.coefficients(part))
        say(f"- level {level}: {len(blob)} bytes; lanes of {exact} of {total} parts == CPU lane decode")
        if exact != total:
            failures.append(f"level {level}: device lanes differ from the CPU's")
        reference = kvcodec.decode(blob, backend="cpu")
        got = kvcodec.decode(blob, device=device, backend="triton").to("cpu")
        diff = max(float((a.float() - b.float()).abs().max()) for x, y in zip(got.layers, reference.layers)
                   for a, b in zip(x, y))
        try:
            assert_within_kvtc_tolerance(blob, got, reference)
            sinks = all(torch.equal(a[:, :1], b[:, :1]) for x, y in zip(got.layers, reference.layers) for a, b in zip(x, y))
            verdict = "within spec/kvtc.md's tolerance of" if sinks else "sink tokens differ from"
        except AssertionError as e:
            verdict, sinks = f"NOT within tolerance ({e}) of", False
        say(f"- level {level}: device decode {verdict} the CPU decode (largest difference {diff:.3g})")
        if not verdict.startswith("within"):
            failures.append(f"level {level}: {verdict} the CPU decode")
    blob = kvcodec.encode(kv, KVTC(level=2, calibration=cal, **lanes), chunk_tokens=24)
    reference = kvcodec.decode(blob, backend="cpu")
    table = torch.tensor([7, 2, 5], dtype=torch.int32)
    slots = slot_mapping(table, 0, kv.num_tokens, 16)
    for layout in ("flash", "gpu", "cpu"):
        paged = [torch.full(empty_shape(layout, 9, 16, 3, 64), float("nan"), dtype=torch.float16, device=device)
                 for _ in kv.layers]
        for codec, section, ctxs in frame_of(blob, device, "triton"):
            at = {c.layer: slot_mapping(table, c.token_start, c.shape.tokens, 16) for c in ctxs}
            codec.decode_frame_paged(section, ctxs, {l: paged[l] for l in at}, at, layout)
        got = kvcodec.KVCache([read_paged(p.cpu(), slots, layout) for p in paged], model=kv.model, rope="post")
        try:
            assert_within_kvtc_tolerance(blob, got, reference)
            say(f"- paged decode ({layout!r} layout) through a shuffled block table within tolerance of the CPU decode")
        except AssertionError as e:
            failures.append(f"paged decode ({layout!r} layout): {e}")
            say(f"- paged decode ({layout!r} layout): NOT within tolerance")
    return failures


def synthetic(layers: int, heads: int, dim: int, theta: float, group_layers: int, tokens: int,
              device: torch.device) -> tuple[Calibration, kvcodec.KVCache]:
    """A calibration of the shape (orthonormal random bases with :data:`SPECTRUM`, unit weights, zero means) and
    a float16 cache of ``tokens`` tokens drawn from it, keys rotated to positions 0..tokens-1."""
    rot = Rotary(theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim))
    infos = [LayerInfo(heads, dim, dim, rot) for _ in range(layers)]
    groups = [list(range(i, min(i + group_layers, layers))) for i in range(0, layers, group_layers)]
    gen = torch.Generator(device).manual_seed(0)
    bases: dict[str, list[GroupBasis]] = {"keys": [], "values": []}
    feats: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}
    for members in groups:
        f = len(members) * heads * dim
        for kind, (scale, alpha) in SPECTRUM.items():
            q, _ = torch.linalg.qr(torch.randn(f, f, generator=gen, device=device))
            basis = q.half()
            variance = scale * torch.arange(1, f + 1, dtype=torch.float32, device=device) ** -alpha
            z = torch.randn(tokens, f, generator=gen, device=device) * variance.sqrt()
            feats[kind].append((z @ basis.float().T).cpu())
            bases[kind].append(GroupBasis(torch.zeros(f), torch.ones(f), basis.cpu(), variance.cpu()))
    cal = Calibration(f"synthetic-{layers}x{heads}x{dim}", infos, groups, bases["keys"], bases["values"],
                      {"synthetic": "bench/gpu_kvtc.py"})
    positions = torch.arange(tokens)
    pairs = []
    for members, k, v in zip(groups, feats["keys"], feats["values"]):
        for j, _ in enumerate(members):
            cols = slice(j * heads * dim, (j + 1) * heads * dim)
            keys = rot.rotate(k[:, cols].reshape(tokens, heads, dim).permute(1, 0, 2), positions)
            pairs.append((keys.half(), v[:, cols].reshape(tokens, heads, dim).permute(1, 0, 2).half().contiguous()))
    return cal, kvcodec.KVCache(pairs, model=cal.model, rope="post")


def contexts(kv: kvcodec.KVCache, codec, device: torch.device, backend: str):
    header = make_header(kv, [codec], chunk_tokens=kv.num_tokens)
    return [layer_context(header, i, (0, kv.num_tokens), device, backend) for i in range(kv.num_layers)]


def throughput(device: torch.device, timer: Timer, say: Callable[[str], None], failures: list[str]) -> None:
    shape = LLAMA if device.type == "cuda" else dict(layers=4, heads=2, dim=64, theta=500000.0)
    token_list = [int(t) for t in ARGS.tokens.split(",")] if device.type == "cuda" else [24]
    group_list = [int(g) for g in ARGS.group_layers.split(",")] if device.type == "cuda" else [2]
    geometries = ([tuple(int(n) for n in g.split("x")) for g in ARGS.lanes.split(",")] if device.type == "cuda"
                  else [(8, 8)])
    say(f"## Throughput: {shape['layers']} layers x {shape['heads']} KV heads x head_dim {shape['dim']}, level "
        f"{ARGS.level}, GB/s of float16 KV (median of up to {timer.repeat} runs, at least 3)")
    say("")
    say("| tokens | layers/group | lanes | fp16 MB | kvtc bits/elem | coded K/V per group | kvtc decode | kvtc decode into paged | "
        "kvtc lane kernel | kvtc CPU decode | peak extra MB | cachegen bits/elem | cachegen decode | cachegen kernel | "
        "D2D copy |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tokens in token_list:
        for group_layers in group_list:
            cal, kv = synthetic(**shape, group_layers=group_layers, tokens=tokens, device=device)
            size = kv.num_elements * 2
            gbs = lambda s: f"{size / s / 1e9:.2f}"  # noqa: E731
            on_device = kv.to(device)
            for lane_components, lane_tokens in geometries:
                try:
                    codec = KVTC(level=ARGS.level, calibration=cal, lane_components=lane_components,
                                 lane_tokens=lane_tokens)
                    cpu_ctxs = contexts(kv, codec, torch.device("cpu"), "cpu")
                    section = codec.encode_frame([(l.keys, l.values) for l in kv.layers], cpu_ctxs)
                    bits = 8 * len(section) / kv.num_elements
                    coded = codec.coded_components()
                    ctxs = contexts(kv, codec, device, "triton")
                    wanted = set(range(kv.num_layers))
                    t_dec = timer(lambda: codec.decode_frame(section, ctxs, wanted))
                    paged = {l: torch.empty(empty_shape("flash", -(-tokens // 16), 16, shape["heads"], shape["dim"]),
                                            dtype=torch.float16, device=device) for l in wanted}
                    slots = {l: torch.arange(tokens, device=device) for l in wanted}
                    t_paged = timer(lambda: codec.decode_frame_paged(section, ctxs, paged, slots, "flash"))
                    _, launch = staged_lanes(codec, section, ctxs, device)
                    t_kernel = timer(launch.run)
                    # the device decode against the CPU decode of this chunk too (one run, timed)
                    t0 = time.perf_counter()
                    reference = codec.decode_frame(section, cpu_ctxs, wanted)
                    t_cpu = time.perf_counter() - t0
                    got = codec.decode_frame(section, ctxs, wanted)
                    worst = max(float(((got[l][i].float().cpu() - reference[l][i].float()).abs()
                                       / (reference[l][i].float().abs() + 1)).max()) for l in wanted for i in range(2))
                    if worst > 1e-2:
                        failures.append(f"{tokens} tokens, groups of {group_layers}: device decode is {worst:.3g} "
                                        "(relative) from the CPU decode")
                    peak = "-"
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        codec.decode_frame(section, ctxs, wanted)
                        torch.cuda.synchronize()
                        peak = f"{(torch.cuda.max_memory_allocated() - base - size) / 1e6:.1f}"
                    cachegen_cells = cachegen(on_device, lane_components, lane_tokens, timer, gbs)
                    mean_coded = f"{np.mean([k for k, _ in coded]):.0f}/{np.mean([v for _, v in coded]):.0f}"
                    say(f"| {tokens} | {group_layers} | {lane_components}x{lane_tokens} | {size / 1e6:.1f} | {bits:.3f} | "
                        f"{mean_coded} | {gbs(t_dec)} | {gbs(t_paged)} | {gbs(t_kernel)} | {gbs(t_cpu)} | {peak} | "
                        f"{' | '.join(cachegen_cells)} |")
                    del got, reference, paged, launch
                except Exception:  # noqa: BLE001 - report and go on to the next row
                    failures.append(f"{tokens} tokens, groups of {group_layers}, lanes {lane_components}x{lane_tokens}: "
                                    f"{traceback.format_exc(limit=4)}")
                    say(f"| {tokens} | {group_layers} | {lane_components}x{lane_tokens} | failed, see below |"
                        + " |" * 11)
            del on_device
    say("")
    say("kvtc bits/elem: the frame's section (every group's tables, lanes and sinks) over its elements, no container "
        "header. coded K/V per group: key and value components coded (the basis rows a decode may multiply). "
        "kvtc decode: `decode_frame` from the section's host bytes to float16 [H, T, D] tensors on the device (parse, "
        "staging, lane kernel, products, RoPE, sinks). Into paged: the same into a flash-layout tensor per layer. "
        "Lane kernel: the staged launch alone. Peak extra MB: device memory allocated during a decode beyond its "
        "float16 output. cachegen columns: `cachegen:level=L` with the same lane geometry (channels x tokens) on the "
        "same chunk, decode_layers from host bytes and its staged kernel; D2D copy: a device copy of the chunk's size.")


def cachegen(pairs_kv: kvcodec.KVCache, lane_channels: int, lane_tokens: int, timer: Timer,
             gbs: Callable[[float], str]) -> list[str]:
    """cachegen's bits, device decode from host bytes and staged kernel on the same chunk."""
    from kvcodec.codecs.cachegen.device import DecodeLaunch
    from kvcodec.codecs.entropy.device import dense_destination

    codec = kvcodec.get_codec("cachegen", level=ARGS.level, lane_channels=lane_channels, lane_tokens=lane_tokens)
    kv = kvcodec.KVCache([(l.keys, l.values) for l in pairs_kv.layers])  # no model: no profile fits a made-up shape
    ctxs = contexts(kv, codec, pairs_kv.device, "triton")
    sections = codec.encode_layers([(l.keys, l.values) for l in kv.layers], ctxs)
    t_dec = timer(lambda: codec.decode_layers(sections, ctxs))
    parts = [p for s, c in zip(sections, ctxs) for p in codec.parse(s, c)[0]]
    out = torch.empty(kv.num_elements, dtype=torch.float16, device=pairs_kv.device)
    h, t, d = parts[0].shape
    launch = DecodeLaunch(codec, parts, [dense_destination(x) for x in out.view(len(parts), h, t, d)])
    t_kernel = timer(launch.run)
    bits = 8 * sum(map(len, sections)) / kv.num_elements
    dst = torch.empty_like(out)
    return [f"{bits:.3f}", gbs(t_dec), gbs(t_kernel), gbs(timer(lambda: dst.copy_(out)))]


def main() -> int:
    device = device_or_none(ARGS.device)
    if device is None:
        return 2
    say = Report(device, "gpu_kvtc", "kvtc on the GPU (Triton lanes, products and RoPE on the device)")
    say("## Correctness on real SmolLM2 KV and its calibration (the device against the CPU path)")
    say("")
    failures = check_correctness(device, say)
    say("")
    throughput(device, Timer(device, ARGS.repeat if device.type == "cuda" else 1), say, failures)
    return say.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
