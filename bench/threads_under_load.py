"""Encode and decode speed of every codec when another CPU job competes for the cores, side by side.

    python bench/threads_under_load.py [--dump PATH] [--repeat 3] [--codec SPEC ...]

For each codec, and each repeat in turn (so drift in the machine's other load hits every column alike):
  - quiet: kvcodec's default (threads=1), no competing job of ours;
  - loaded: the same while a competing job runs (one busy process per ``--competitors``);
  - old default, loaded: torch's own thread count (one per core), which every call used before the
    ``threads`` option, under the same competing job.
The target: no codec's loaded encode or decode more than 1.5x its quiet 1-thread time.  Writes
bench/results/threads_under_load.md.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import kvcodec
from cpu_codecs import calibrate_for, load_dump  # bench/ is on sys.path when this runs as a script
from kvcodec.cli import parse_codec

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CODECS = ["raw", "fp8", "zstd", "kivi:bits=4", "lmcache-cachegen", "cachegen", "kvfetcher", "kvtc"]
TARGET = 1.5


def timed(kv: kvcodec.KVCache, codec: object, threads: int, calls: int = 1) -> tuple[float, float]:
    """Mean seconds of one encode and one decode over ``calls`` of each."""
    enc = dec = 0.0
    for _ in range(calls):
        t0 = time.perf_counter()
        blob = kvcodec.encode(kv, codec, threads=threads)
        t1 = time.perf_counter()
        kvcodec.decode(blob, threads=threads)
        enc, dec = enc + t1 - t0, dec + time.perf_counter() - t1
    return enc / calls, dec / calls


class Competitors:
    """``n`` busy processes (a pure-Python loop each: one core's worth of CPU demand apiece)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Competitors:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.3)  # let them reach the scheduler before the clock starts
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", help="a safetensors KV dump (default: 1536 tokens of real_kv.gpl3_kv)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--competitors", type=int, default=1, help="busy processes in the competing job (default: 1)")
    p.add_argument("--codec", action="append", help=f"codec specs (default: {' '.join(DEFAULT_CODECS)})")
    args = p.parse_args()
    kv = load_dump(args.dump)
    calibrate_for(args.codec or DEFAULT_CODECS)
    load_before = os.getloadavg()[0]
    old_default = torch.get_num_threads()  # what torch picks for this machine: what every call used before
    rows = []
    for spec in args.codec or DEFAULT_CODECS:
        codec = parse_codec(spec)
        warm = sum(timed(kv, codec, 1))  # warm-up: imports, tables, first allocations
        # calls short enough for scheduler noise to matter are timed over several, half a second in all
        calls = max(1, math.ceil(0.5 / max(warm, 1e-3)))
        runs: dict[str, list[tuple[float, float]]] = {"quiet": [], "loaded": [], "old": []}
        for _ in range(args.repeat):
            runs["quiet"].append(timed(kv, codec, 1, calls))
            with Competitors(args.competitors):
                runs["loaded"].append(timed(kv, codec, 1, calls))
                runs["old"].append(timed(kv, codec, old_default, calls))
        med = {k: (statistics.median(e for e, _ in v), statistics.median(d for _, d in v)) for k, v in runs.items()}
        rows.append((spec, med))
        print(f"{spec:18s} enc {med['quiet'][0]:6.2f} / {med['loaded'][0]:6.2f} / {med['old'][0]:6.2f} s   "
              f"dec {med['quiet'][1]:6.2f} / {med['loaded'][1]:6.2f} / {med['old'][1]:6.2f} s", flush=True)
    worst = max(max(m["loaded"][0] / m["quiet"][0], m["loaded"][1] / m["quiet"][1]) for _, m in rows)
    lines = [f"# Encode and decode under a competing CPU job ({kv}, {kv.nbytes / 1e6:.1f} MB float16)", "",
             f"Median of {args.repeat} runs each, interleaved (a run of a codec that takes under half a second is the "
             "mean of several calls). *quiet*: `threads=1` (kvcodec's default) with no "
             f"competing job of ours; *loaded*: the same while {args.competitors} busy process(es) run; *old default, "
             f"loaded*: torch's own {old_default} threads (what every call used before the `threads` option) under "
             f"the same job. The machine has {os.cpu_count()} cores and is shared with other work, which no column "
             "escapes.", "",
             "| codec | enc s quiet | enc s loaded | ratio | enc s old default, loaded | ratio | dec s quiet | "
             "dec s loaded | ratio | dec s old default, loaded | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for spec, m in rows:
        (eq, dq), (el, dl), (eo, do) = m["quiet"], m["loaded"], m["old"]
        lines.append(f"| `{spec}` | {eq:.2f} | {el:.2f} | {el / eq:.2f}x | {eo:.2f} | {eo / eq:.2f}x | {dq:.2f} | "
                     f"{dl:.2f} | {dl / dq:.2f}x | {do:.2f} | {do / dq:.2f}x |")
    lines += ["", f"Worst loaded/quiet ratio with the default: {worst:.2f}x (target: at most {TARGET}x): "
              + ("met." if worst <= TARGET else "NOT met."),
              "", f"Made by `python bench/threads_under_load.py` on a shared 2-core machine (load average "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, other users' jobs included)."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "threads_under_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
