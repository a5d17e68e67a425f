"""What `kvcodec calibrate` costs: wall time, CPU-seconds, peak resident memory and file size per model and set of
options, each run in a fresh process one after another (issue 36's goals: at most 3 minutes and 3 GB for SmolLM2 on 2
idle cores, at most 3 GB for any model up to 0.5B with every option).

    python bench/calibrate_cost.py [--model smollm2 --model gemma3-270m] [--options "" --options "--loss-weights yes"]
                                   [--runs 2] [--name calibrate_cost]

Peak resident memory is the process's own (``ru_maxrss``), in GB of 10^9 bytes; the file's SHA-256 shows whether
the runs made the same calibration.  The machine should be otherwise idle: the times are wall-clock.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import tempfile
from pathlib import Path

from kvtc_defaults import RESULTS, calibrate

from kvcodec.models import GEMMA3, SMOLLM2

GOAL_GB = 3.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help=f"models (default: {SMOLLM2} and {GEMMA3})")
    p.add_argument("--options", action="append",
                   help="a set of calibrate options, quoted (default: none, and --loss-weights yes)")
    p.add_argument("--runs", type=int, default=2, help="runs of each (default 2)")
    p.add_argument("--name", default="calibrate_cost", help="results file name in bench/results without suffix")
    args = p.parse_args()
    option_sets = args.options if args.options is not None else ["", "--loss-weights yes"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model or [SMOLLM2, GEMMA3]:
            for options in option_sets:
                for run in range(args.runs):
                    out = os.path.join(tmp, f"{Path(model).name}-{run}.kvtc")
                    cost = calibrate(model, out, shlex.split(options))
                    digest = hashlib.sha256(Path(out).read_bytes()).hexdigest()[:12]
                    rows.append((model, options or "(defaults)", cost, digest))
                    print(f"{model} {options}: {cost['wall_s']:.0f} s, {cost['cpu_s']:.0f} CPU-s, "
                          f"{cost['peak_rss_gb']:.2f} GB", flush=True)
    lines = ["# What `kvcodec calibrate` costs", "",
             f"`python bench/calibrate_cost.py` ({args.runs} runs of each, one after another, each a fresh process). "
             f"Peak resident memory in GB (10^9 bytes); the 3 GB goal is issue 36's.", "",
             "| model | options | wall | CPU-seconds | peak resident memory | under 3 GB | file | SHA-256 |",
             "|---|---|---|---|---|---|---|---|"]
    for model, options, cost, digest in rows:
        wall = f"{int(cost['wall_s'] // 60)} min {cost['wall_s'] % 60:.0f} s"
        lines.append(f"| {model} | `{options}` | {wall} | {cost['cpu_s']:.0f} | {cost['peak_rss_gb']:.2f} GB | "
                     f"{'yes' if cost['peak_rss_gb'] <= GOAL_GB else 'no'} | {cost['file_mb']:.1f} MB | {digest} |")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
