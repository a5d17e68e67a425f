"""kvtc design measurements on real SmolLM2 KV: transform choices, layer grouping, basis size, levels.

    python bench/kvtc_probe.py [--tokens 1536] [--continuation 512] [--quick]

Calibrates on the calibration texts (kvcodec.codecs.kvtc.calibration.DEFAULT_CALIBRATION_TEXTS), evaluates on
the default evaluation texts (no overlap), every container byte counted: bits per element, perplexity change
when the model continues from the decoded cache, greedy agreement, calibration (basis) size and CPU decode
speed.  Calibrations are cached in .cache/kvtc/.  Writes bench/results/kvtc_probe.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from kvcodec.api import decode, encode
from kvcodec.codecs.kvtc import KVTC, Calibration, calibrate
from kvcodec.evaluate import evaluate, prepare
from kvcodec.models import load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "kvtc"
RESULTS = Path(__file__).resolve().parent / "results"

# (label, calibrate() options)
TRANSFORMS = [
    ("per-layer PCA, keys after RoPE", dict(group_layers=1, undo_rope=False, weight_keys=False)),
    ("per-layer PCA, keys before RoPE", dict(group_layers=1, weight_keys=False)),
    ("all layers in one PCA, keys before RoPE", dict(group_layers=None, weight_keys=False)),
    ("groups of 5, keys before RoPE, query-weighted", dict(group_layers=5)),
    ("groups of 10, keys before RoPE, query-weighted", dict(group_layers=10)),
    ("all layers, keys before RoPE, query-weighted", dict(group_layers=None)),
]


def cached_calibration(model, name: str, **options) -> Calibration:
    path = CACHE / f"{model.model_id}-{name}.kvtc"
    if path.exists():
        return Calibration.load(path)
    t0 = time.time()
    cal = calibrate(model, **options)
    CACHE.mkdir(parents=True, exist_ok=True)
    cal.save(path)
    print(f"calibrated {name} in {time.time() - t0:.0f} s", file=sys.stderr)
    return cal


def decode_speed(kv, codec, repeat: int = 2) -> tuple[float, float]:
    """Encode and decode M elements/s on one thread (median of ``repeat``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        enc, dec = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            blob = encode(kv, codec)
            t1 = time.perf_counter()
            decode(blob)
            dec.append(time.perf_counter() - t1)
            enc.append(t1 - t0)
    finally:
        torch.set_num_threads(threads)
    return kv.num_elements / sorted(enc)[len(enc) // 2] / 1e6, kv.num_elements / sorted(dec)[len(dec) // 2] / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    p.add_argument("--levels", default="0,1,2,3,4", help="levels for the query-weighted transforms")
    p.add_argument("--only", action="append", help="only transforms whose label contains this")
    args = p.parse_args()
    model = load_model("smollm2")
    cases = [prepare(model, text, args.tokens, args.continuation) for text in DEFAULT_EVAL_TEXTS]
    levels = [int(x) for x in args.levels.split(",")]
    lines = [f"# kvtc design measurements ({model.model_id})", "",
             f"Calibration texts: {', '.join(cases and __import__('kvcodec.codecs.kvtc.calibration', fromlist=['x']).DEFAULT_CALIBRATION_TEXTS)}. "
             f"Evaluation texts: {', '.join(DEFAULT_EVAL_TEXTS)}; {args.tokens}-token prefix in float16, perplexity "
             f"of the next {args.continuation} tokens, mean over texts; every container byte counted (the calibration "
             "file is not in the container: its size is the basis column). Decode/encode speeds on one thread, "
             "whole container.", "",
             "| transform | level | bits/element | perplexity change | agreement | key / value components | basis MB (fp16) | encode M el/s | decode M el/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, options in TRANSFORMS:
        if args.only and not any(o in label for o in args.only):
            continue
        name = "-".join(f"{k}={v}" for k, v in sorted(options.items()))
        cal = cached_calibration(model, name, **options)
        weighted = options.get("weight_keys", True)
        codecs = [KVTC(level=lv, calibration=cal) for lv in (levels if weighted else [2])]
        rows = evaluate(model, cases, codecs, labels=[f"level={c.level}" for c in codecs])
        enc_speed, dec_speed = decode_speed(cases[0].kv, codecs[len(codecs) // 2])
        comps = f"{sum(b.components for b in cal.keys)} / {sum(b.components for b in cal.values)}"
        for r in rows:
            lines.append(f"| {label} | {r.codec} | {r.bits_per_element:.3f} | {100 * r.ppl_change:+.2f}% | "
                         f"{100 * r.agreement:.1f}% | {comps} | {cal.basis_bytes / 1e6:.0f} | {enc_speed:.1f} | {dec_speed:.1f} |")
        print("\n".join(lines[-len(rows):]), flush=True)
    lines += ["", f"Made by `python bench/kvtc_probe.py` on a shared 2-core CPU ({os.cpu_count()} cores visible)."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kvtc_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
