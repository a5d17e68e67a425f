"""The store's adaptive load against each fixed variant, over an in-process link: load time and wasted bytes.

Real SmolLM2 KV (the first ``--tokens`` tokens of ``license:GPL-3``, float16, ``--chunk``-token chunks) kept in
three stores behind links that serve the same rate trace: ``["cachegen", "raw"]`` (adaptive), ``cachegen`` alone and
``raw`` alone.  A link is a memory tier whose reads (whole or ranged, as Redis's) sleep for the time the trace takes
to carry their bytes, starting when the read starts, so a rise or a drop reaches a read under way.  Each store is
warmed with ``--warm`` loads over its trace (its decode rates and link estimate are then its own), then loaded
``--reps`` times; each cell is the median.  Rates: 20 Mbit/s, 100 Mbit/s, 1 Gbit/s, 10 Gbit/s, and a rise from
20 Mbit/s to 10 Gbit/s ``--rise-at`` seconds into each load.  The machine's cores are shared: compare within a run.
Writes ``bench/results/adaptive_inprocess.md`` (``--out``).

    python bench/adaptive_inprocess.py [--tokens 512] [--chunk 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from real_kv import gpl3_kv  # bench/ is on sys.path when this runs as a script

from kvcodec.store import DenseSink, KVStore, MemoryTier

OUT = Path(__file__).parent / "results" / "adaptive_inprocess.md"
MBIT = 1e6 / 8  # bytes per second


class TracedLink(MemoryTier):
    """Memory behind a link whose rate (bytes/s) follows ``trace(seconds since restart())``."""

    def __init__(self) -> None:
        super().__init__(None, name="link")
        self.trace = lambda t: 1e9
        self.t0 = time.perf_counter()

    def restart(self, trace) -> None:
        self.trace, self.t0 = trace, time.perf_counter()

    def _carry(self, value: bytes | None) -> bytes | None:
        """Sleep while the trace carries ``value`` (in steps of at most 1 ms of the trace)."""
        left = 0 if value is None else len(value)
        while left > 0:
            rate = self.trace(time.perf_counter() - self.t0)
            step = min(left, rate * 0.001)
            time.sleep(step / rate)
            left -= step
        return value

    def get(self, key, max_bytes=None):
        return self._carry(super().get(key, max_bytes))

    def get_range(self, key, offset, length, max_bytes=None):
        value = MemoryTier.get(self, key, max_bytes)
        return self._carry(None if value is None else value[offset:offset + length])


def _store(codec, ids, kv, chunk: int) -> tuple[KVStore, TracedLink]:
    link = TracedLink()
    store = KVStore([link], model=kv.model, codec=codec, chunk_tokens=chunk)
    store.put(ids, kv)
    return store, link


def _load(store: KVStore, link: TracedLink, ids, trace) -> tuple[float, int, int, str]:
    link.restart(trace)
    t0 = time.perf_counter()
    result = store.prefix_load(ids, DenseSink()).start().finish()
    took = time.perf_counter() - t0
    assert result.complete, [c.status for c in result.chunks]
    names = "".join("cr"[c.variant] if len(store.variants) > 1 else "-" for c in result.chunks)
    return took, result.nbytes, result.wasted_bytes, names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--chunk", type=int, default=64, help="tokens per chunk (default 64)")
    parser.add_argument("--reps", type=int, default=3, help="measured loads per cell, median (default 3)")
    parser.add_argument("--warm", type=int, default=2, help="loads before measuring (default 2)")
    parser.add_argument("--rise-at", type=float, default=0.1, help="seconds into a load the rise comes (0.1)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the table (default {OUT})")
    args = parser.parse_args(argv)
    kv = gpl3_kv(args.tokens)
    ids = list(range(args.tokens))
    traces = {"20 Mbit/s": lambda t: 20 * MBIT, "100 Mbit/s": lambda t: 100 * MBIT,
              "1 Gbit/s": lambda t: 1000 * MBIT, "10 Gbit/s": lambda t: 10000 * MBIT,
              f"rise 20 Mbit/s -> 10 Gbit/s at {args.rise_at} s":
                  lambda t: 20 * MBIT if t < args.rise_at else 10000 * MBIT}
    stores = {name: _store(codec, ids, kv, args.chunk)
              for name, codec in (("adaptive", ["cachegen", "raw"]), ("cachegen", "cachegen"), ("raw", "raw"))}
    rows = []
    for label, trace in traces.items():
        cells, runs_of = {}, {}
        for name, (store, link) in stores.items():
            for _ in range(args.warm):
                _load(store, link, ids, trace)
            runs = [_load(store, link, ids, trace) for _ in range(args.reps)]
            mid = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            cells[name] = (statistics.median(r[0] for r in runs), mid)
            runs_of[name] = runs
        best = min(("cachegen", "raw"), key=lambda n: cells[n][0])
        took, (_, used, wasted, names) = cells["adaptive"]
        worst = max(w / max(u, 1) for _, u, w, _ in runs_of["adaptive"])
        rows.append(f"| {label} | {cells['cachegen'][0] * 1e3:.0f} | {cells['raw'][0] * 1e3:.0f} | "
                    f"{took * 1e3:.0f} | {took / cells[best][0]:.2f} ({best}) | {used / 1e6:.2f} | "
                    f"{wasted / 1e6:.2f} | {100 * wasted / max(used, 1):.1f}% | {100 * worst:.1f}% | `{names}` |")
        print(rows[-1], flush=True)
    table = "\n".join([
        "# Adaptive load over an in-process link\n",
        (f"`python bench/adaptive_inprocess.py --tokens {args.tokens} --chunk {args.chunk} --reps {args.reps} "
         f"--warm {args.warm} --rise-at {args.rise_at}`\n"),
        (f"Real SmolLM2 KV, {args.tokens} tokens in {args.chunk}-token chunks (float16), each store warmed with "
         f"{args.warm} loads over its trace, then the median of {args.reps} loads (ms). Adaptive keeps "
         "`[\"cachegen\", \"raw\"]`; the ratio is its time over the best fixed variant's; used and wasted are the "
         "bytes its median load used and read without using, beside the most any of its loads wasted; the last "
         "column is each chunk's variant (c: cachegen, r: raw). Shared machine: compare within the table.\n"),
        ("| link | cachegen ms | raw ms | adaptive ms | adaptive / best fixed | used MB | wasted MB | wasted / used "
         "| worst load's wasted / used | chunks |"),
        "|---|---|---|---|---|---|---|---|---|---|", *rows, ""])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
