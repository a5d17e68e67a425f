"""kvtc with and without loss-measured layer weights, side by side on the same caches.

    python bench/studies/kvtc_loss_weights.py [--model smollm2] [--levels 2] [--texts 3] [--statistics FILE]

Collects the calibration statistics once (or reads them from ``--statistics``, writing them there first when the
file does not exist: they take minutes), then fits three calibrations from them: the channel weights read off
the model's matrices alone (``none``), with each layer's value weights scaled so a unit error costs the same
measured loss in every layer (``values``; see kvcodec/codecs/kvtc/sensitivity.py), and with the keys' scaled
too (``keys+values``: ``kvcodec calibrate --loss-weights``).  Each is evaluated at ``--levels`` with the
protocol of bench/rate_distortion.py on the first ``--texts`` evaluation texts.  Writes bench/studies/results/kvtc_loss_weights-<model>.md.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from kvcodec.codecs.kvtc import KVTC, register_calibration
from kvcodec.tools.evaluate import evaluate, prepare
from kvcodec.codecs.kvtc.fit import collect_statistics, fit
from kvcodec.codecs.kvtc.sensitivity import SENSITIVITY_TEXTS, equalized_weights
from kvcodec.models import load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {"none": None, "values": (False, True), "keys+values": (True, True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--levels", default="2", help="comma-separated kvtc levels")
    p.add_argument("--texts", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--statistics", help="a file to read the statistics from (written first if missing)")
    args = p.parse_args()
    model = load_model(args.model, progress=False)
    if args.statistics and os.path.exists(args.statistics):
        stats = torch.load(args.statistics, weights_only=False)
    else:
        stats = collect_statistics(model)
        if args.statistics:
            torch.save(stats, args.statistics)
    cases = [prepare(model, text, 1536, 512) for text in DEFAULT_EVAL_TEXTS[:args.texts]]
    levels = [int(x) for x in args.levels.split(",")]
    rows, costs = [], {}
    for name in args.variants.split(","):
        kw, vw = stats.key_weights, stats.value_weights
        if VARIANTS[name] is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            kw, vw = equalized_weights(model, kw, vw, keys=VARIANTS[name][0], values=VARIANTS[name][1])
            costs[name] = (time.perf_counter() - t0, time.process_time() - c0)
        cal = register_calibration(fit(stats, None, stats.settings | {"loss_weights": name}, kw, vw))
        rows += evaluate(model, cases, [KVTC(level=lv, calibration=cal) for lv in levels],
                         labels=[f"{name}, level {lv}" for lv in levels])
        print(rows[-1], flush=True)
    lines = [f"# kvtc layer weights measured from the loss ({model.model_id})", "",
             f"Texts: {', '.join(c.name for c in cases)}; 1536-token float16 prefix, perplexity of the next 512 tokens, "
             "mean over texts; bits count every container byte. One set of calibration statistics "
             f"({stats.settings['tokens']} tokens of {', '.join(stats.settings['texts'])}); the loss measured on "
             f"{', '.join(SENSITIVITY_TEXTS)} (see kvcodec/codecs/kvtc/sensitivity.py).", "",
             "| layer weights scaled by the measured loss | bits/element | perplexity change | agreement |",
             "|---|---|---|---|"]
    lines += [f"| {r.codec} | {r.bits_per_element:.3f} | {100 * r.ppl_change:+.3f}% | {100 * r.agreement:.2f}% |"
              for r in rows]
    lines += ["", "Cost of the loss measurement (both kinds measured in one pass; wall and process CPU seconds): "
              + "; ".join(f"{n} {w:.0f} s wall, {c:.0f} CPU-s" for n, (w, c) in costs.items()) + ".", "",
              f"Made by `python bench/studies/kvtc_loss_weights.py --model {args.model} --levels {args.levels} --texts "
              f"{args.texts}` (load average {os.getloadavg()[0]:.1f} on the shared 2-core machine)."]
    (RESULTS / f"kvtc_loss_weights-{args.model}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
