"""LMCache's retrieve throughput through kvcodec's remote storage plugin, its Redis behind a real shaped link.

Runs as root in ``.venv-engines`` (``bash scripts/setup_engines.sh``)::

    .venv-engines/bin/python bench/lmcache_link.py [--tokens 2048] [--rates 10,100,1000,10000]

The KV is real (SmolLM2's float16 cache over ``license:GPL-3``, as in ``bench/lmcache_io.py``), in a real
``LMCacheEngine`` on the CPU.  Redis runs in a network namespace reached over a veth pair shaped with tbf
(``kvcodec/tools/netlab.py``) at each rate, and at 100 Gbit/s for the "unshaped" row.  Per codec the KV is stored once
at full speed, then retrieved at each rate in a new engine (nothing in memory); MB/s are of float16 KV, median of
``--reps``.  Writes ``bench/results/lmcache_link.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from lmcache_io import real_kv  # bench/ is on sys.path when this runs as a script

from kvcodec.tools.harness.lmcache_engine import CPUEngine, kvcodec_plugin_config
from kvcodec.tools.netlab import ShapedLink, unavailable
from kvcodec.tools.redis_server import started_redis

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "lmcache_link.md"
UNSHAPED = 100_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rates", default="10,100,1000,10000", help="Mbit/s, comma-separated (plus unshaped)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--codecs", default="raw,cachegen")
    args = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"lmcache_link: {why}")
    tokens, kv = real_kv(args.tokens)
    mb = kv.numel() * kv.element_size() / 1e6
    L, H, D = kv.shape[1], 3, kv.shape[3] // 3
    rates: list[float | str] = [float(r) for r in args.rates.split(",")] + ["unshaped"]
    rows: dict[tuple[str, float | str], float] = {}
    stored: dict[str, int] = {}
    work = Path(tempfile.mkdtemp(prefix="kvcodec-lmcache-link-"))
    with ShapedLink(UNSHAPED) as link:
        redis = started_redis(work, link)
        try:
            for db, codec in enumerate(args.codecs.split(",")):
                url = f"kvcodec://{redis.host}:{redis.port}/{db}?backend=redis&codec={codec}&timeout=600"
                # LMCache gives up on one chunk's get after blocking_timeout_secs (10 s by default), which a raw
                # chunk (5.9 MB) behind a 10 Mbit/s link takes about half of when nothing else shares the link
                config = kvcodec_plugin_config(url, blocking_timeout_secs=600)
                make = lambda: CPUEngine(config, layers=L, heads=H, head_dim=D, dtype=kv.dtype)  # noqa: E731
                link.set_rate(UNSHAPED)
                with make() as engine:
                    engine.store(tokens, kv)
                    engine.settle()
                    stored[codec] = engine.remote_connector().stats["bytes_out"]
                for rate in rates:
                    link.set_rate(UNSHAPED if rate == "unshaped" else rate)
                    seconds = []
                    for _ in range(1 if rate != "unshaped" and stored[codec] * 8 / (rate * 1e6) > 20 else args.reps):
                        with make() as engine:
                            start = time.perf_counter()
                            _, n = engine.retrieve(tokens, kv)
                            seconds.append(time.perf_counter() - start)
                        assert n == len(tokens), f"{codec} at {rate}: retrieved {n} of {len(tokens)} tokens"
                    rows[(codec, rate)] = statistics.median(seconds)
                    print(f"lmcache_link: {codec} at {rate}: {rows[(codec, rate)]:.2f} s, "
                          f"{mb / rows[(codec, rate)]:.0f} MB/s of KV", flush=True)
        finally:
            redis.stop()

    def label(rate: float | str) -> str:
        return rate if isinstance(rate, str) else f"{rate:g} Mbit/s"

    lines = [f"# LMCache retrieve through kvcodec's plugin, Redis behind a shaped link ({args.tokens} tokens)", "",
             f"`python bench/lmcache_link.py --tokens {args.tokens} --rates {args.rates}` on {time.strftime('%Y-%m-%d')}: "
             f"a real LMCacheEngine (0.5.6) on the CPU retrieving {mb:.1f} MB of SmolLM2 float16 KV in a new engine; "
             "seconds, and MB/s of KV, per link rate. Redis in a network namespace behind tbf on a veth pair.", "",
             "| codec | stored MB | " + " | ".join(label(r) for r in rates) + " |", "|---" * (len(rates) + 2) + "|"]
    for codec in args.codecs.split(","):
        cells = [f"{rows[(codec, r)]:.2f} s ({mb / rows[(codec, r)]:.0f} MB/s)" for r in rates]
        lines.append(f"| {codec} | {stored[codec] / 1e6:.1f} | " + " | ".join(cells) + " |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
