"""kvtc's layer grouping: rate, quality, calibration size and speed per core for groups of several sizes.

    python bench/studies/kvtc_grouping.py [--groups 0 30] [--level 2]

Collects SmolLM2's calibration statistics once (the default calibration texts, all 30 layers pooled), fits a
calibration per grouping (0: the default rule, kvtc_calibration.default_groups; 30: all layers in one basis),
and measures each at ``--level`` with the codec's defaults on the three
texts and lengths of bench/rate_distortion.py: bits per element (every container byte), perplexity change,
greedy agreement, the calibration file's size (apart from the containers), and encode/decode
speed per CPU-second of one thread on the first text's cache.  Writes bench/studies/results/kvtc_grouping.md.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from kvcodec.codecs.kvtc import KVTC
from kvcodec.codecs.kvtc.fit import calibrate, collect_statistics
from kvcodec.tools.evaluate import evaluate, measure_throughput, prepare
from kvcodec.models import load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, nargs="+", default=[0, 30], help="layers per basis (0: the default rule)")
    p.add_argument("--level", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    args = p.parse_args()
    model = load_model("smollm2", progress=False)
    load = os.getloadavg()[0]
    features = collect_statistics(model, group_layers=model.model.config.num_hidden_layers)
    cases = [prepare(model, text, args.tokens, args.continuation) for text in DEFAULT_EVAL_TEXTS]
    lines = [f"# kvtc layer grouping at level {args.level} (SmolLM2-135M-Instruct)", "",
             f"Calibration: {features.settings['tokens']} tokens of {', '.join(features.settings['texts'])}. "
             f"Evaluation: {', '.join(DEFAULT_EVAL_TEXTS)}, {args.tokens}-token float16 prefix, perplexity of the "
             f"next {args.continuation} tokens, mean over texts; codec defaults otherwise. Speed: one thread, M "
             "elements per CPU-second of the process on the first text's cache (median of 3).", "",
             "| layers per basis | components coded (K + V, all groups) | calibration MB | fit s | bits/element "
             "| perplexity change | agreement | encode M/CPU-s | decode M/CPU-s |", "|---|---|---|---|---|---|---|---|---|"]
    for size in args.groups:  # the fit uses torch's threads; the codec calls run on one (their default)
        t0 = time.perf_counter()
        cal = calibrate(model, group_layers=size or None, statistics=features)
        fit = time.perf_counter() - t0
        codec = KVTC(level=args.level, calibration=cal)
        row = evaluate(model, cases, [codec])[0]
        speed = measure_throughput(cases[0].kv, codec).to_dict()
        coded = sum(map(sum, codec.coded_components()))
        label = size or f"default rule ({', '.join(str(len(g)) for g in cal.groups)})"
        lines.append(f"| {label} | {coded} | {len(cal.to_bytes()) / 1e6:.1f} | {fit:.0f} | "
                     f"{row.bits_per_element:.3f} | {100 * row.ppl_change:+.3f}% | {100 * row.agreement:.2f}% | "
                     f"{speed['encode_Melem_per_cpu_s']:.2f} | {speed['decode_Melem_per_cpu_s']:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", f"Made by `python bench/studies/kvtc_grouping.py` on a shared 2-core machine (load average {load:.1f} "
              f"before, {os.getloadavg()[0]:.1f} after)."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kvtc_grouping.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
