"""kvtc design measurements on real SmolLM2 KV: layer grouping, weighting, basis size, steps.

    python bench/studies/kvtc_probe.py [--text license:GPL-3] [--tokens 1024] [--continuation 256] [--max-tokens 8192]

Collects calibration statistics once (all layers pooled) (kvcodec.codecs.kvtc.fit.DEFAULT_CALIBRATION_TEXTS, none of them an
evaluation text), fits each grouping from them, and evaluates each at a few (key step, value step) pairs on the
evaluation text: bits per element (every container byte counted; the calibration file is not in the
container, its basis size is its own column), perplexity change when the model continues from the decoded
cache, greedy agreement, and the wall times of the encode and decode (whole cache, torch's default threads,
on a shared machine: compare within a run only).  Calibrations are saved in .cache/kvtc/.  Writes
bench/studies/results/kvtc_probe.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvcodec.codecs.kvtc import KVTC
from kvcodec.codecs.kvtc import codec as kvtc_codec
from kvcodec.codecs.kvtc.fit import DEFAULT_CALIBRATION_TEXTS, calibrate, collect_statistics
from kvcodec.tools.evaluate import evaluate, prepare
from kvcodec.models import load_model

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
ALL = 30  # SmolLM2's layers
CONFIGS = [("all layers, weighted", dict(group_layers=ALL)), ("groups of 10, weighted", dict(group_layers=10)),
           ("groups of 5, weighted", dict(group_layers=5)),
           ("per layer, keys unweighted", dict(group_layers=1, weight_keys=False)),
           ("all layers, keys unweighted", dict(group_layers=ALL, weight_keys=False))]
STEPS = [(0.2, 0.6), (0.1, 0.4)]  # (key step, value step) in the weighted domain
PROBE_LEVEL = 100  # a level number outside the codec's table, set per measurement


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default="license:GPL-3")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8192, help="calibration tokens at most")
    args = p.parse_args()
    model = load_model("smollm2")
    t0 = time.time()
    feats = collect_statistics(model, group_layers=ALL, max_tokens=args.max_tokens)
    case = prepare(model, args.text, args.tokens, args.continuation)
    lines = [f"# kvtc design measurements ({model.model_id})", "",
             f"Calibration: {feats.settings['tokens']} tokens of {', '.join(DEFAULT_CALIBRATION_TEXTS)}. Evaluation: "
             f"{args.text}, {args.tokens}-token prefix in float16, perplexity of the next {args.continuation} tokens "
             f"(reference {case.ref_ppl:.3f}). Steps are (key, value) in the weighted transform domain.", "",
             "| transform | steps | bits/element | perplexity change | agreement | key / value components | basis MB (fp16) | fit s | encode s | decode s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cache = ROOT / ".cache" / "kvtc"
    cache.mkdir(parents=True, exist_ok=True)
    for label, options in CONFIGS:
        t = time.time()
        cal = calibrate(model, statistics=feats, finest_steps=(0.05, 0.2), **options)
        fit_s = time.time() - t
        cal.save(cache / f"probe-{label.replace(' ', '').replace(',', '-')}.kvtc")
        comps = f"{sum(b.components for b in cal.keys)} / {sum(b.components for b in cal.values)}"
        for steps in STEPS if "unweighted" not in label else STEPS[:1]:
            kvtc_codec.LEVELS[PROBE_LEVEL] = steps
            r = evaluate(model, [case], [KVTC(level=PROBE_LEVEL, calibration=cal)])[0]
            lines.append(f"| {label} | {steps} | {r.bits_per_element:.3f} | {100 * r.ppl_change:+.2f}% | "
                         f"{100 * r.agreement:.1f}% | {comps} | {cal.basis_bytes / 1e6:.0f} | {fit_s:.0f} | "
                         f"{r.encode_s:.1f} | {r.decode_s:.1f} |")
            print(lines[-1], flush=True)
    lines += ["", f"Made by `python bench/studies/kvtc_probe.py` in {time.time() - t0:.0f} s on a shared 2-core CPU."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kvtc_probe.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
