"""Per-core CPU encode and decode speed of every codec on a real SmolLM2 cache, side by side.

    python bench/cpu_codecs.py [--dump PATH] [--repeat 3]

Runs with one torch thread and reports millions of KV elements per second
(median of the runs) and MB/s of the float16 cache; writes
bench/results/cpu_codecs.md.  Machines here are shared and noisy: compare the
rows of one run with each other, not with another run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import kvcodec
from kvcodec.cli import parse_codec
from kvcodec.evaluate import measure_throughput

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CODECS = ["raw", "fp8", "zstd", "kivi:bits=2", "kivi:bits=4", "lmcache-cachegen",
                  "cachegen:level=0", "cachegen:level=2", "cachegen:level=4"]


DEFAULT_DUMP = os.path.join(os.path.dirname(__file__), "..", ".cache", "bench-gpl3-1536.safetensors")


def load_dump(path: str) -> kvcodec.KVCache:
    """The benches' real cache (1536 tokens of SmolLM2 over the GPL-3), dumped on first use."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        subprocess.run(["kvcodec", "dump", "--model", "smollm2", "--text", "license:GPL-3", "--tokens", "1536",
                        "-o", path, "--quiet"], check=True)
    return kvcodec.KVCache.load_safetensors(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", default=DEFAULT_DUMP)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--codec", action="append", help=f"codec specs (default: {' '.join(DEFAULT_CODECS)})")
    args = p.parse_args()
    torch.set_num_threads(1)
    kv = load_dump(args.dump)
    rows = []
    for spec in args.codec or DEFAULT_CODECS:
        m = measure_throughput(kv, parse_codec(spec), args.repeat).to_dict()
        rows.append((spec, m["bits_per_element"], m["encode_Melem_s"], m["decode_Melem_s"], m["encode_MBps"],
                     m["decode_MBps"]))
        print(f"{spec:22s} {rows[-1][1]:6.3f} bits/elem  enc {rows[-1][2]:7.2f}  dec {rows[-1][3]:7.2f} Melem/s", flush=True)
    ceiling = _constriction_ceiling(kv.num_elements, args.repeat)
    lines = [f"# CPU speed per core ({kv}, {kv.nbytes / 1e6:.1f} MB float16)", "",
             f"One torch thread, median of {args.repeat} runs, whole cache encoded and decoded through the container.", "",
             "| codec | bits/element | encode Melem/s | decode Melem/s | encode MB/s | decode MB/s |", "|---|---|---|---|---|---|"]
    lines += [f"| `{r[0]}` | {r[1]:.3f} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.0f} | {r[5]:.0f} |" for r in rows]
    lines += [f"| constriction alone: one table, one stream, same symbol count (cachegen's ceiling) | - | "
              f"{ceiling[0]:.2f} | {ceiling[1]:.2f} | - | - |"]
    lines += ["", "Made by `python bench/cpu_codecs.py` on a shared 2-core machine."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_codecs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _constriction_ceiling(n: int, repeat: int) -> tuple[float, float]:
    """Melem/s of constriction's AnsCoder on n symbols of one codebook table in one call each way."""
    import constriction
    import numpy as np

    from kvcodec.codecs.cachegen.tables import codebook, models

    table = 12  # std of one step: typical of cachegen's symbols
    symbols = np.random.default_rng(0).choice(codebook().shape[1], n, p=codebook()[table] / 2 ** 24).astype(np.int32)
    enc, dec = [], []
    for _ in range(repeat):
        coder = constriction.stream.stack.AnsCoder()
        t0 = time.perf_counter()
        coder.encode_reverse(symbols, models()[table])
        enc.append(time.perf_counter() - t0)
        words = coder.get_compressed()
        t0 = time.perf_counter()
        constriction.stream.stack.AnsCoder(words).decode(models()[table], n)
        dec.append(time.perf_counter() - t0)
    return n / statistics.median(enc) / 1e6, n / statistics.median(dec) / 1e6


if __name__ == "__main__":
    sys.exit(main())
