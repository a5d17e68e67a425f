"""kvtc with `kvcodec calibrate`'s defaults, on every model given, beside cachegen's default, in one run.

    python bench/kvtc_defaults.py [--model smollm2 --model gemma3-270m] [--tokens 1536] [--continuation 512]
                                  [--calibration MODEL=FILE] [--spec bits=1.0] [--name kvtc_defaults]

Per model: `kvcodec calibrate --model M` with no options (its wall time, CPU-seconds, peak resident memory and
file size, from the process's own resource usage), then `kvtc` at its default level with that calibration and
`cachegen` at its default, on the evaluation texts and on the out-of-domain kinds (kvcodec.texts.OUT_OF_DOMAIN_TEXTS:
essay, configuration file, data table, code, release notes): bits per element (every container byte counted),
perplexity change and greedy agreement when the model continues from the decoded cache, and KL from the float16
cache's next-token distributions, per text and per set.  A kvtc row meets its target when it is at most the rate
goal (0.6 bits on SmolLM2, 1.0 on other models), at most +1% and at most cachegen's KL on the same texts.
``--calibration MODEL=FILE`` uses a file made before instead of calibrating; ``--keep DIR`` keeps those made;
``--spec OPTIONS`` adds a column of `kvtc:OPTIONS` with the same calibration (e.g. ``bits=1.0``: the rate goal's
KL).  Writes bench/results/NAME.md/json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvcodec.cli import parse_codec
from kvcodec.models import SMOLLM2, load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS, OUT_OF_DOMAIN_TEXTS
from kvcodec.tools.evaluate import EvalRow, evaluate, prepare

RESULTS = Path(__file__).resolve().parent / "results"
RATE_GOAL = {SMOLLM2: 0.6}  # bits/element at the default level; 1.0 on other models
OTHER_RATE_GOAL = 1.0
PPL_GOAL = 0.01
SETS = {"evaluation texts": list(DEFAULT_EVAL_TEXTS), "out-of-domain kinds": list(OUT_OF_DOMAIN_TEXTS)}


def calibrate(model: str, out: str, options: list[str] | None = None) -> dict[str, float]:
    """Run `kvcodec calibrate --model MODEL -o OUT [OPTIONS]` (no options: its defaults); its wall time,
    CPU-seconds and peak RSS.  Call it from a small process: the child's peak RSS starts from this process's size
    at the fork (``ru_maxrss`` survives the exec)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvcodec", "calibrate", "--model", model, "-o", out, "--quiet",
                             *(options or [])])
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"kvcodec calibrate --model {model} failed ({status})")
    return {"wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9, "file_mb": os.path.getsize(out) / 1e6}


def measure(model_spec: str, calibration: str, tokens: int, continuation: int,
            specs: list[str]) -> dict[str, dict[str, EvalRow]]:
    """Per text, the rows of kvtc (at its default level, then with each of ``specs``' options) and cachegen."""
    model = load_model(model_spec, progress=False)
    codecs = {"kvtc": parse_codec(f"kvtc:calibration={calibration}")}
    codecs |= {f"kvtc:{s}": parse_codec(f"kvtc:{s},calibration={calibration}") for s in specs}
    codecs["cachegen"] = parse_codec("cachegen")
    out = {}
    for text in dict.fromkeys(t for texts in SETS.values() for t in texts):
        case = prepare(model, text, tokens, continuation)
        rows = evaluate(model, [case], list(codecs.values()), labels=list(codecs))
        out[text] = {r.codec: r for r in rows}
        print(text, {k: (round(r.bits_per_element, 3), f"{100 * r.ppl_change:+.2f}%", round(r.kl, 4))
                     for k, r in out[text].items()}, flush=True)
    return out


def mean(rows: list[EvalRow]) -> dict[str, float]:
    elements = sum(r.bytes * 8 / r.bits_per_element for r in rows)
    return {"bits": 8 * sum(r.bytes for r in rows) / elements, "change": sum(r.ppl_change for r in rows) / len(rows),
            "agreement": sum(r.agreement for r in rows) / len(rows), "kl": sum(r.kl for r in rows) / len(rows)}


def cell(m: dict[str, float]) -> str:
    return f"{m['bits']:.3f}, {100 * m['change']:+.2f}%, {100 * m['agreement']:.1f}%, {m['kl']:.4f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="models (default: smollm2 and gemma3-270m)")
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    p.add_argument("--calibration", action="append", default=[], help="MODEL=FILE: use this file, do not calibrate")
    p.add_argument("--spec", action="append", default=[], help="OPTIONS: also kvtc:OPTIONS (e.g. bits=1.0)")
    p.add_argument("--keep", help="write the calibrations made into this folder (default: a temporary one)")
    p.add_argument("--name", default="kvtc_defaults", help="results file name in bench/results without suffix")
    args = p.parse_args()
    given = dict(c.split("=", 1) for c in args.calibration)
    t0 = time.time()
    lines = ["# kvtc with `kvcodec calibrate`'s defaults", "",
             f"{args.tokens}-token prefixes cached in float16, the next {args.continuation} tokens scored. Cells: "
             "bits/element, perplexity change, greedy agreement, KL (nats per token); `kvtc` at its default level "
             "with the calibration `kvcodec calibrate --model M` makes with no options, `cachegen` at its default "
             "(level 2). Target: at most the rate goal, at most +1% and at most cachegen's KL.", ""]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or tmp
        for model in args.model or [SMOLLM2, "gemma3-270m"]:
            path = given.get(model) or os.path.join(tmp, f"{Path(model).name}.kvtc")
            cost = None if model in given else calibrate(model, path)
            per_text = measure(model, path, args.tokens, args.continuation, args.spec)
            goal = RATE_GOAL.get(model, OTHER_RATE_GOAL)
            lines += [f"## {model} (rate goal {goal} bits)", ""]
            if cost:
                lines += [f"`kvcodec calibrate --model {model}`: {cost['wall_s']:.0f} s wall, {cost['cpu_s']:.0f} "
                          f"CPU-seconds, peak resident memory {cost['peak_rss_gb']:.2f} GB, file "
                          f"{cost['file_mb']:.1f} MB.", ""]
            extra = [f"kvtc:{s}" for s in args.spec]
            lines += ["| texts | kvtc (default level) | " + "".join(f"`{e}` | " for e in extra)
                      + "cachegen level 2 | target met |", "|---|---|---|---|" + "---|" * len(extra)]
            for name, texts in [(t, [t]) for t in per_text] + list(SETS.items()):
                k = mean([per_text[t]["kvtc"] for t in texts])
                c = mean([per_text[t]["cachegen"] for t in texts])
                met = k["bits"] <= goal and k["change"] <= PPL_GOAL and k["kl"] <= c["kl"]
                label = f"**{name}** (mean)" if len(texts) > 1 else f"`{name}`"
                more = "".join(f"{cell(mean([per_text[t][e] for t in texts]))} | " for e in extra)
                lines.append(f"| {label} | {cell(k)} | {more}{cell(c)} | {'yes' if met else 'no'} |")
            lines.append("")
            results[model] = {"calibration": cost, "rows": {t: {c: r.to_dict() for c, r in rows.items()}
                                                            for t, rows in per_text.items()}}
    lines.append(f"Made by `python bench/{' '.join([Path(__file__).name] + sys.argv[1:])}` in {time.time() - t0:.0f} s "
                 f"on a 2-core CPU; load average {os.getloadavg()[0]:.1f} at the end. On shared cores the wall time "
                 "is not the idle machine's, and CPU-seconds overstate the work too: BLAS threads spin while they "
                 "wait for a core (a 1920-wide eigendecomposition took 1.2 CPU-s on one thread, 18.6 on two at a "
                 "load average of 5).")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"prefix_tokens": args.tokens, "continuation_tokens":
                                                           args.continuation, "models": results}, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
