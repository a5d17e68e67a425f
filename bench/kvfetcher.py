"""kvfetcher bench: size and quality on real SmolLM2 KV next to cachegen, CPU speed, decode buffer, and the
pipelined / adaptive-resolution fetch simulation.  Writes bench/results/kvfetcher.md.

    python bench/kvfetcher.py                  # everything (the perplexity part takes minutes)
    python bench/kvfetcher.py --skip-quality   # the rest
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

import kvcodec
from kvcodec.adapt import BandwidthTrace
from kvcodec.chunking import layer_context, make_header
from kvcodec.codecs import get_codec
from kvcodec.codecs.kvfetcher import adapt as A
from kvcodec.codecs.kvfetcher import layout as L
from kvcodec.codecs.kvfetcher import video
from kvcodec.codecs.kvfetcher.codec import KVFetcher, SectionHead
from kvcodec.codecs.kvfetcher.paged import restore_paged

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = Path("/tmp/kvfetcher-bench.json")


def real_kv(tokens: int = 512) -> kvcodec.KVCache:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import CACHE_DIR, _dump_version  # the test suite's cached dumps

    from kvcodec.cli import main

    path = CACHE_DIR / f"license-GPL-3-{tokens}-float16-{_dump_version()}.safetensors"
    if not path.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        assert main(["dump", "--model", "smollm2", "--text", "license:GPL-3", "--tokens", str(tokens),
                     "--dtype", "float16", "-o", str(path), "--quiet"]) == 0
    return kvcodec.KVCache.load_safetensors(path)


def quality() -> list[dict]:
    from kvcodec.evaluate import evaluate, prepare
    from kvcodec.models import load_model
    from kvcodec.texts import DEFAULT_EVAL_TEXTS

    model = load_model("smollm2")
    cases = [prepare(model, t, 1536, 512) for t in DEFAULT_EVAL_TEXTS]
    specs = [("kvfetcher", dict(bits=3)), ("kvfetcher", dict(bits=4)), ("kvfetcher", dict(bits=5)),
             ("kvfetcher", dict(bits=4, delta=True)),
             ("kvfetcher", dict(bits=4, scale="spread")), ("kvfetcher", dict(bits=4, scale="spread", preset="veryfast")),
             ("kvfetcher", dict(bits=4, scale="spread", key_step=2, value_spread=0.85)),
             ("kvfetcher", dict(bits=4, scale="spread", key_step=2, value_spread=1.0, preset="veryfast")),
             ("kvfetcher", dict(bits=4, scale="spread", key_step=3, value_spread=1.3, preset="veryfast")),
             ("cachegen", dict(level=0)), ("cachegen", dict(level=2)), ("cachegen", dict(level=4)),
             ("kivi", dict(bits=4, group=128))]
    codecs = [get_codec(c, **cfg) for c, cfg in specs]
    labels = [c + ":" + ",".join(f"{k}={v}" for k, v in cfg.items()) for c, cfg in specs]
    rows = evaluate(model, cases, codecs, labels=labels)
    return [r.to_dict() for r in rows]


def speed(kv: kvcodec.KVCache) -> dict:
    mb = kv.num_elements * 2 / 1e6
    out = {}
    for bits in (4, 8):
        codec = KVFetcher(bits=bits)
        enc, dec = [], []
        for _ in range(3):  # best of 3: the machine is shared
            t0 = time.perf_counter()
            blob = kvcodec.encode(kv, codec=codec)
            t1 = time.perf_counter()
            kvcodec.decode(blob)
            t2 = time.perf_counter()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
        out[bits] = dict(encode_mb_s=mb / min(enc), decode_mb_s=mb / min(dec), bpe=8 * len(blob) / kv.num_elements,
                         encode_s=min(enc), decode_s=min(dec), mb=mb, all_encode_s=enc, all_decode_s=dec)
    return out


def frame_costs(kv: kvcodec.KVCache, heights=A.DEFAULT_LADDER) -> dict:
    """Bytes per frame and PyAV decode (+ restore) seconds per frame, per height, on real KV (layers 0, 10, 20, 29)."""
    bits = 4
    res = {}
    for h in heights:
        nbytes, frames, secs = 0, 0, 0.0
        for li in (0, 10, 20, 29):
            k, v = kv.layers[li]
            codec = KVFetcher(bits=bits, frame_tokens=h)
            for kq in codec.quantize(k, v)[:2]:
                geo = L.geometry(kq.shape[1], 3, 64, 64, h)
                frs = [L.to_frame(kq[:, lo:lo + geo.frame_rows], geo, bits, False) for lo in range(0, kq.shape[1], geo.frame_rows)]
                s = video.encode_frames(frs, bits)
                t = time.perf_counter()
                for _ in range(3):
                    for f in video.decode_stream([s], geo.rows, geo.cols, bits, len(frs)):
                        L.from_frame(f, geo.frame_rows, 3, 64, bits, False)
                secs += (time.perf_counter() - t) / 3
                nbytes += len(s)
                frames += len(frs)
        res[h] = dict(frame_bytes=nbytes / frames, decode_s=secs / frames)
    return res


def buffer_peak(kv: kvcodec.KVCache) -> list[dict]:
    """Peak decode-side memory while restoring into paged blocks, against context length (the real cache tiled)."""
    rows = []
    codec = KVFetcher(bits=4, frame_tokens=256)
    layers = [0, 15]
    for reps in (1, 4, 16):
        tokens = 512 * reps
        sub = kvcodec.KVCache([(k.repeat(1, reps, 1), v.repeat(1, reps, 1)) for k, v in (kv.layers[i] for i in layers)])
        header = make_header(sub, [codec], 256)
        blocks = tokens // 16
        table = torch.randperm(blocks + 8)[:blocks].int()
        sections = []
        for li in range(sub.num_layers):
            k, v = sub.layers[li]
            for c0 in range(0, tokens, 256):
                ctx = layer_context(header, li, (c0, c0 + 256), torch.device("cpu"))
                sections.append((li, ctx, codec.encode_layer(k[:, c0:c0 + 256], v[:, c0:c0 + 256], ctx)))
        paged = [torch.zeros(2, blocks + 8, 16, 3, 64, dtype=torch.float16) for _ in layers]
        tracemalloc.start()
        frame_peak = 0
        for li, ctx, data in sections:
            frame_peak = max(frame_peak, restore_paged(data, ctx, paged[li], table))
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        geo = SectionHead(sections[0][2], sections[0][1]).geo
        rows.append(dict(tokens=tokens, frames_held=1, picture_bytes=geo.frame_bytes, dequant_bytes=frame_peak,
                         numpy_peak_bytes=traced, output_bytes=sum(p.numel() * 2 for p in paged)))
    return rows


def simulation(costs: dict, layers: int = 30) -> dict:
    """Restore time on bandwidth traces for an 8192-token SmolLM2 context (30 layers, K and V frames)."""
    heights = tuple(sorted((int(h) for h in costs), reverse=True))
    model = A.FrameModel({h: costs[h]["frame_bytes"] for h in heights}, {h: costs[h]["decode_s"] for h in heights},
                         frames_per_block=2 * layers)
    tokens, gop = 8192, 1024
    total = sum(model.frame_bytes[256] * model.gop_frames(256, gop) for _ in range(tokens // gop))
    dec_total = model.decode_s[256] * model.gop_frames(256, gop) * (tokens // gop)
    rate = total / dec_total  # a link about as fast as the (CPU) decoder
    traces = [BandwidthTrace.steady(rate, "steady (link = decoder)"),
              BandwidthTrace.steady(rate / 4, "steady slow (link = decoder / 4)"),
              BandwidthTrace.from_rates([rate * 2, rate / 8, rate * 2, rate / 8, rate * 2], dec_total / 5, "dropping"),
              BandwidthTrace.jittery(rate, 10 * dec_total, dec_total / 50, sigma=1.0, seed=7, name="jittery (sigma 1)"),
              BandwidthTrace.jittery(rate, 10 * dec_total, dec_total / 200, sigma=1.5, seed=11, name="jittery (sigma 1.5)")]
    out = {}
    for tr in traces:
        rows = []
        for pol in [A.ResolutionPolicy(model)] + [A.FixedHeight(h) for h in heights]:
            r = A.simulate_fetch(model, tr, tokens, gop, pol)
            rows.append(dict(name=r.name, restored_s=r.restored_s, arrived_s=r.arrived_s, heights=r.heights,
                             peak_frames_held=r.peak_frames_held, mb=r.bytes_sent / 1e6))
        seq = A.simulate_fetch(model, tr, tokens, gop, A.FixedHeight(256), pipelined=False)
        rows.append(dict(name=seq.name, restored_s=seq.restored_s, arrived_s=seq.arrived_s, heights=seq.heights,
                         peak_frames_held=seq.peak_frames_held, mb=seq.bytes_sent / 1e6))
        out[tr.name] = rows
    return dict(rate_mb_s=rate / 1e6, model={h: dict(frame_bytes=model.frame_bytes[h], decode_ms=1e3 * model.decode_s[h])
                                             for h in heights}, traces=out)


def write(res: dict) -> str:
    lines = ["# kvfetcher: KV as lossless HEVC (x265 through PyAV on the CPU)", "",
             "Real SmolLM2-135M-Instruct KV (float16).  `python bench/kvfetcher.py`.  Every container byte counted "
             "(header with token ids, index, checksums, section heads, float16 scales, HEVC streams).", ""]
    if "quality" in res:
        lines += ["## Size and quality (3 texts, 1536-token prefix, perplexity of the next 512 tokens)", "",
                  "| codec | bits/element | perplexity change | agreement | encode s | decode s |", "|---|---|---|---|---|---|"]
        for r in sorted(res["quality"], key=lambda r: (r["codec"].split(":")[0], r["bits_per_element"])):
            lines.append(f"| {r['codec']} | {r['bits_per_element']:.3f} | {100 * r['ppl_change']:+.3f}% | "
                         f"{100 * r['agreement']:.2f}% | {r['encode_s']:.1f} | {r['decode_s']:.1f} |")
        lines.append("")
        if res.get("quality_note"):
            lines += [res["quality_note"], ""]
    if "entropy" in res:
        e = res["entropy"]
        lines += ["## Why min-max 4-bit codes do not reach 2.7 bits", "",
                  f"Zeroth-order entropy of the min-max 4-bit codes (ideal per-channel tables, no scales) on the 512-token cache: "
                  f"keys {e['keys']:.2f}, values {e['values']:.2f} bits/code; min-max codes of real KV use the 16 levels "
                  f"widely.  x265 lossless on them: {e['hevc']:.2f} bits/code without the token delta, "
                  f"{e['hevc_delta']:.2f} with it (the delta of neighbouring tokens has *more* entropy than the codes "
                  f"on real KV: {e['delta_keys']:.2f} / {e['delta_values']:.2f} bits), so `delta` is off by default.", ""]
    s = res["speed"]
    lines += ["## CPU speed (one process, 2 cores, 512-token cache, 30 layers, MB of float16 KV per second, best of 3)", "",
              "| bits | bits/element | encode MB/s | decode MB/s |", "|---|---|---|---|"]
    for b, r in s.items():
        lines.append(f"| {b} | {r['bpe']:.3f} | {r['encode_mb_s']:.2f} | {r['decode_mb_s']:.2f} |")
    lines += ["", "## Decode buffer while restoring into paged blocks (frame by frame)", "",
              "| context tokens | frames held | picture bytes | dequantized frame bytes | numpy peak (tracemalloc) | paged output bytes |",
              "|---|---|---|---|---|---|"]
    for r in res["buffer"]:
        lines.append(f"| {r['tokens']} | {r['frames_held']} | {r['picture_bytes']} | {r['dequant_bytes']} | "
                     f"{r['numpy_peak_bytes']} | {r['output_bytes']} |")
    sim = res["simulation"]
    lines += ["", "## Fetch simulation (8192 tokens, 30 layers, GOP = 1024 tokens; frame sizes and PyAV decode times "
              "measured on real 4-bit codes)", "",
              "Per frame: " + ", ".join(f"{h} rows: {m['frame_bytes']:.0f} B, {m['decode_ms']:.2f} ms"
                                        for h, m in sim["model"].items()) +
              f".  Link mean {sim['rate_mb_s']:.2f} MB/s (as fast as the decoder at 256 rows).", ""]
    for name, rows in sim["traces"].items():
        best_fixed = min(r["restored_s"] for r in rows if r["name"].startswith("fixed") and "sequential" not in r["name"])
        lines += [f"### {name}", "", "| strategy | restored s | last byte s | vs best fixed | heights | peak frames held |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            hs = ",".join(str(h) for h in r["heights"])
            lines.append(f"| {r['name']} | {r['restored_s']:.3f} | {r['arrived_s']:.3f} | "
                         f"{100 * (r['restored_s'] / best_fixed - 1):+.1f}% | {hs} | {r['peak_frames_held']} |")
        lines.append("")
    lines += ["## Against the issue's targets", ""]
    q = res.get("quality", [])
    q4 = next((r for r in q if r["codec"] == "kvfetcher:bits=4"), None)
    spread = [r for r in q if r["codec"].startswith("kvfetcher:bits=4,scale=spread")]
    if q4:
        met = [r for r in spread if r["bits_per_element"] <= 2.7 and r["ppl_change"] <= 0.015]
        text = (f"- At most 2.7 bits/element at 4-bit codes: **{'met' if met else 'not met'}**.  Min-max codes: "
                f"{q4['bits_per_element']:.3f} (perplexity {100 * q4['ppl_change']:+.3f}%); their own entropy is about "
                "3.46 bits and the float16 per-token value scales add 0.25, so no lossless coder of them gets there.")
        if spread:
            small = min(spread, key=lambda r: r["bits_per_element"])
            good = [r for r in spread if r["ppl_change"] <= 0.015]
            text += ("  `scale=spread` (steps from the query RMS for keys and the token's spread for values, codes "
                     "centred, never clipped) concentrates the codes: ")
            if good:
                g = min(good, key=lambda r: r["bits_per_element"])
                text += (f"`{g['codec']}` holds the perplexity at {100 * g['ppl_change']:+.3f}% with "
                         f"{g['bits_per_element']:.3f} bits/element; ")
            text += (f"the smallest setting measured, `{small['codec']}`, reaches {small['bits_per_element']:.3f} "
                     f"bits/element at {100 * small['ppl_change']:+.3f}%.  The rest of the gap: the per-token value "
                     "scales (0.25 bits/element), x265's lossless coding 0.4-0.5 bits/code above the codes' "
                     "zeroth-order entropy (0.07 less with preset=veryfast), and no exact sink token (cachegen keeps "
                     "the first token in float16).  Tried first and dropped: steps of a fixed number of standard "
                     "deviations per channel for keys *and* values with outliers clipped (2.4-3.2 bits/element, but "
                     "+33% to +52% perplexity: the first token, which attention piles onto, lost its precision).")
        text += "  At every size, cachegen is smaller and better."
        lines.append(text)
    lines.append("- Lossless w.r.t. the codes: met on the CPU (bit-exact codes, checked by a digest in every section); "
                 "the NVDEC side awaits `bench/gpu_kvfetcher.py` on a GPU.")
    lines.append(f"- Peak decode buffer under 70 MB: met on the CPU path, one frame held whatever the context "
                 f"(about {max(r['numpy_peak_bytes'] for r in res['buffer']) / 1e6:.2f} MB of numpy allocations at "
                 "8192 tokens).")
    gains = []
    for name, rows in sim["traces"].items():
        if name.startswith("jittery"):
            best = min(r["restored_s"] for r in rows if r["name"].startswith("fixed") and "sequential" not in r["name"])
            ad = next(r["restored_s"] for r in rows if r["name"] == "adaptive ladder")
            gains.append(f"{name}: {100 * (1 - ad / best):+.1f}%")
    lines.append("- Adaptive ladder at least 15% sooner than the best fixed height under jitter: **not met**; "
                 "sooner by " + ", ".join(gains) + ".  With measured frame sizes and decode times, bigger frames "
                 "cost fewer header bytes and less per-frame decode overhead, so 1024 rows is (nearly) always best "
                 "and the ladder's job reduces to finding it: it never does worse than the best fixed height and "
                 "beats the worst (128 rows) by 6-18%.  Small frames only pay off for the pipeline tail of short streams "
                 "with few frames per block (the tests show the policy picking them there).  Pipelining against "
                 "sequential decoding is the large gain: 1.25-2x sooner.")
    return "\n".join(lines) + "\n"


def entropy(kv: kvcodec.KVCache) -> dict:
    def h_cols(a: np.ndarray) -> float:
        tot = 0.0
        for c in range(a.shape[1]):
            _, cnt = np.unique(a[:, c], return_counts=True)
            p = cnt / cnt.sum()
            tot += -(p * np.log2(p)).sum() * len(a)
        return tot / a.size

    ek, ev, dk, dv, hb, hd, n = [], [], [], [], 0, 0, 0
    for li in range(0, 30, 3):
        k, v = kv.layers[li]
        for c0 in (0, 256):
            codec = KVFetcher(bits=4)
            kq, vq, _ = codec.quantize(k[:, c0:c0 + 256], v[:, c0:c0 + 256])
            K, V = (q.transpose(1, 0, 2).reshape(256, -1) for q in (kq, vq))
            ek.append(h_cols(K)); ev.append(h_cols(V))
            dk.append(h_cols(np.diff(K, axis=0) & 15)); dv.append(h_cols(np.diff(V, axis=0) & 15))
            geo = L.geometry(256, 3, 64, 64, 256)
            hb += len(video.encode_frames([L.to_frame(kq, geo, 4, False), L.to_frame(vq, geo, 4, False)], 4))
            hd += len(video.encode_frames([L.to_frame(kq, geo, 4, True), L.to_frame(vq, geo, 4, True)], 4))
            n += kq.size + vq.size
    m = statistics.fmean
    return dict(keys=m(ek), values=m(ev), delta_keys=m(dk), delta_values=m(dv), hevc=8 * hb / n, hevc_delta=8 * hd / n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--report-only", action="store_true", help="rewrite the markdown from the last run's numbers")
    args = ap.parse_args()
    if args.report_only:
        (RESULTS / "kvfetcher.md").write_text(write(json.loads(CACHE.read_text())))
        return
    torch.set_num_threads(2)
    res = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    kv = real_kv()
    if not args.skip_quality:
        res["quality"] = quality()
        res.pop("quality_note", None)
        CACHE.write_text(json.dumps(res))
    res["entropy"] = entropy(kv)
    res["speed"] = speed(kv)
    res["buffer"] = buffer_peak(kv)
    costs = frame_costs(real_kv(1024))  # 1024-row frames need 1024 real tokens
    res["simulation"] = simulation(costs)
    CACHE.write_text(json.dumps(res))
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = write(json.loads(json.dumps(res)))
    (RESULTS / "kvfetcher.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
