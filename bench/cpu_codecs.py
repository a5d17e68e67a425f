"""Per-core CPU encode and decode speed of every codec on a real SmolLM2 cache, side by side.

    python bench/cpu_codecs.py [--dump PATH] [--repeat 3] [--codec SPEC ...] [--name FILE]

Runs with one torch thread and reports millions of KV elements per second
(median of the runs) and MB/s of the float16 cache, by the wall clock and per
CPU-second of the process (the speed per core, which other jobs on a shared
machine disturb far less than the wall clock), and the decode's CPU time per
chunk of 256 tokens (kvcodec's default chunk: what a load waits for); writes
bench/results/cpu_codecs.md (``--name``: another file, for another set of ``--codec`` specs).  Compare the
rows of one run with each other.
kvtc uses the calibration installed for SmolLM2, computed first if there is none.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

import kvcodec
from kvcodec.chunking import DEFAULT_CHUNK_TOKENS
from kvcodec.cli import parse_codec
from kvcodec.tools.evaluate import measure_throughput
from real_kv import gpl3_kv  # bench/ is on sys.path when this runs as a script

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CODECS = ["raw", "fp8", "zstd", "kivi:bits=2", "kivi:bits=4", "lmcache-cachegen",
                  "cachegen:level=0", "cachegen:level=2", "cachegen:level=4", "kvtc:level=2", "kvtc:level=4"]


def load_dump(path: str | None) -> kvcodec.KVCache:
    """The cache in ``path``, or the benches' real one (1536 tokens of SmolLM2 over the GPL-3)."""
    return kvcodec.KVCache.load_safetensors(path) if path else gpl3_kv(1536)


def calibrate_for(specs: list[str]) -> None:
    """Install SmolLM2's kvtc calibration (computed once, minutes) when a spec needs it."""
    if any(spec.startswith("kvtc") for spec in specs):
        from kvcodec.codecs.kvtc.fit import ensure_calibration
        from kvcodec.models import load_model

        ensure_calibration(load_model("smollm2", progress=False), log=lambda line: print(line, file=sys.stderr))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", help="a safetensors KV dump (default: 1536 tokens of real_kv.gpl3_kv)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--codec", action="append", help=f"codec specs (default: {' '.join(DEFAULT_CODECS)})")
    p.add_argument("--name", default="cpu_codecs", help="results file in bench/results, without .md (default: %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(1)
    kv = load_dump(args.dump)
    specs = args.codec or DEFAULT_CODECS
    calibrate_for(specs)
    load = os.getloadavg()[0]
    rows = []
    for spec in specs:
        m = measure_throughput(kv, parse_codec(spec), args.repeat).to_dict()
        rows.append((spec, m["bits_per_element"], m["encode_Melem_s"], m["decode_Melem_s"], m["encode_MBps"],
                     m["decode_MBps"], m["encode_Melem_per_cpu_s"], m["decode_Melem_per_cpu_s"]))
        print(f"{spec:22s} {rows[-1][1]:6.3f} bits/elem  enc {rows[-1][2]:7.2f}  dec {rows[-1][3]:7.2f} Melem/s wall, "
              f"enc {rows[-1][6]:7.2f}  dec {rows[-1][7]:7.2f} Melem/CPU-s", flush=True)
    ceiling = _constriction_ceiling(kv.num_elements, args.repeat)
    lines = [f"# CPU speed per core ({kv}, {kv.nbytes / 1e6:.1f} MB float16)", "",
             f"One torch thread, median of {args.repeat} runs, whole cache encoded and decoded through the container. "
             "*Per CPU-s*: elements per second of the process's own CPU time (the speed of one core, which other "
             "jobs on the machine barely change); *wall*: by the clock.", "",
             f"*Decode CPU-ms per chunk*: the decode's CPU time per chunk of {DEFAULT_CHUNK_TOKENS} tokens "
             f"({kv.num_elements // kv.num_tokens * DEFAULT_CHUNK_TOKENS / 1e6:.2f} M elements).", "",
             "| codec | bits/element | encode Melem/CPU-s | decode Melem/CPU-s | decode CPU-ms per chunk | encode Melem/s wall "
             "| decode Melem/s wall | encode MB/s wall | decode MB/s wall |", "|---|---|---|---|---|---|---|---|---|"]
    chunks = -(-kv.num_tokens // DEFAULT_CHUNK_TOKENS)
    lines += [f"| `{r[0]}` | {r[1]:.3f} | {r[6]:.2f} | {r[7]:.2f} | {kv.num_elements / r[7] / 1e3 / chunks:.1f} | {r[2]:.2f} "
              f"| {r[3]:.2f} | {r[4]:.0f} | {r[5]:.0f} |" for r in rows]
    lines += [f"| constriction alone: one table, one stream, same symbol count (cachegen's ceiling) | - | - | - | - | "
              f"{ceiling[0]:.2f} | {ceiling[1]:.2f} | - | - |"]
    lines += ["", f"Made by `{shlex.join(['python', 'bench/cpu_codecs.py'] + sys.argv[1:])}` on a 2-core machine shared with other jobs (load average "
              f"{load:.1f} before, {os.getloadavg()[0]:.1f} after)."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _constriction_ceiling(n: int, repeat: int) -> tuple[float, float]:
    """Melem/s of constriction's AnsCoder on n symbols of one codebook table in one call each way."""
    import constriction
    import numpy as np

    from kvcodec.codecs.entropy.tables import codebook, models

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
