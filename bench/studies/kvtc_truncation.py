"""How many kvtc components to code: rate, quality and speed per core as ``min_std`` drops the small ones.

    python bench/studies/kvtc_truncation.py [--level 2] [--min-std 0 0.2 0.3]

On the three texts and lengths of bench/rate_distortion.py (SmolLM2, the calibration installed for it), for
each ``min_std`` (components whose calibration std is below that many steps are not coded): bits per element
(every container byte), perplexity change and greedy agreement, the components coded, and encode/decode speed
per CPU-second of one thread on the first text's cache.  Writes bench/studies/results/kvtc_truncation.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from kvcodec.codecs.kvtc import KVTC
from kvcodec.codecs.kvtc.fit import ensure_calibration
from kvcodec.tools.evaluate import evaluate, measure_throughput, prepare
from kvcodec.models import load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", type=int, action="append", help="kvtc levels (default: 2 and 4)")
    p.add_argument("--min-std", type=float, nargs="+", default=[0.0, 0.2, 0.3])
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    args = p.parse_args()
    model = load_model("smollm2", progress=False)
    cal = ensure_calibration(model, log=lambda line: print(line, file=sys.stderr))
    cases = [prepare(model, text, args.tokens, args.continuation) for text in DEFAULT_EVAL_TEXTS]
    load = os.getloadavg()[0]
    lines = ["# kvtc: components coded (min_std) against rate, quality and speed (SmolLM2-135M-Instruct)", "",
             f"Texts {', '.join(DEFAULT_EVAL_TEXTS)}; {args.tokens}-token float16 prefix, perplexity of the next "
             f"{args.continuation} tokens, mean over texts. Calibration {cal.digest[:16]} (all layers in one basis: "
             f"{cal.keys[0].components} key and {cal.values[0].components} value components). Speed: one thread, "
             "Melem per CPU-second of the process on the first text's cache (median of 3).", "",
             "| level | min_std | components coded (K / V) | bits/element | perplexity change | agreement "
             "| encode Melem/CPU-s | decode Melem/CPU-s |", "|---|---|---|---|---|---|---|---|"]
    torch.set_num_threads(1)
    for level in args.level or [2, 4]:
        for min_std in args.min_std:
            codec = KVTC(level=level, calibration=cal, min_std=min_std)
            row = evaluate(model, cases, [codec])[0]
            speed = measure_throughput(cases[0].kv, codec).to_dict()
            coded = codec.coded_components()[0]
            lines.append(f"| {level} | {min_std:g} | {coded[0]} / {coded[1]} | {row.bits_per_element:.3f} | "
                         f"{100 * row.ppl_change:+.3f}% | {100 * row.agreement:.2f}% | "
                         f"{speed['encode_Melem_per_cpu_s']:.2f} | {speed['decode_Melem_per_cpu_s']:.2f} |")
            print(lines[-1], flush=True)
    lines += ["", f"Made by `python bench/studies/kvtc_truncation.py` on a shared 2-core machine (load average {load:.1f} "
              f"before, {os.getloadavg()[0]:.1f} after)."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kvtc_truncation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
