"""Time to first token from Redis behind a real shaped link, against recomputing the prefix (SmolLM2, CPU).

A ``--prefix``-token prefix of ``license:GPL-3`` plus 16 new tokens.  Redis runs in a network namespace reached
over a veth pair shaped with tbf (``kvcodec/tools/netlab.py``; root only) at each ``--rates`` Mbit/s, and on loopback
for the unshaped row.  For raw and cachegen the prefix's KV is stored once, then
:class:`~kvcodec.engines.transformers_hook.TransformersKVHook` answers the request: fetch every chunk, decode layer
by layer while the model reads the 16 new tokens, first token.  The model runs on torch's threads, the codecs on
one.  Median of ``--reps`` runs (one at rates where a raw load takes over 20 s).  Writes
``bench/results/store_link.md``.

    python bench/store_link.py [--prefix 1024] [--rates 10,100,1000] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kvcodec.engines.transformers_hook import TransformersKVHook
from kvcodec.store import KVStore, MemoryTier, RedisTier
from kvcodec.models import load_model
from kvcodec.tools.netlab import ShapedLink, unavailable
from kvcodec.tools.redis_server import started_redis
from kvcodec.texts import load_text

OUT = Path(__file__).parent / "results" / "store_link.md"
CODECS = ("raw", "cachegen")


def ttft(hook: TransformersKVHook, ids: list[int], reps: int) -> tuple[float, int]:
    """Median seconds to the first token, and the prefix tokens loaded."""
    runs = [hook.generate(ids, 1) for _ in range(reps)]
    return statistics.median(r.first_token_s for r in runs), runs[-1].loaded_tokens


def measure(lm, ids: list[int], prefix: int, server, link, rate: float | None, reps: int) -> list[dict]:
    rows = []
    tier = RedisTier(server.host, server.port, timeout_s=30.0)
    for codec in CODECS:
        store = KVStore([tier], model=lm.model_id, codec=codec)
        if link is not None:
            link.set_rate(10000)  # store at full speed; only the load is timed
        store.put(ids[:prefix], lm.prefill(ids[:prefix]))
        nbytes = sum(len(c.data) for c in store.fetch(ids[:prefix]))
        if link is not None:
            link.set_rate(rate)
        slow = rate is not None and nbytes * 8 / (rate * 1e6) > 20
        seconds, loaded = ttft(TransformersKVHook(lm, store, save=False), ids, 1 if slow else reps)
        rows.append({"rate": rate, "codec": codec, "bytes": nbytes, "ttft_s": seconds, "loaded": loaded})
        print(f"store_link: {'unshaped' if rate is None else f'{rate:g} Mbit/s'} {codec}: {seconds:.2f} s, "
              f"{nbytes / 1e6:.1f} MB, {loaded} tokens loaded", flush=True)
        store.evict(ids[:prefix])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=1024, help="prefix tokens whose KV is stored (default 1024)")
    p.add_argument("--rates", default="10,100,1000", help="link rates in Mbit/s, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"store_link: {why}")
    lm = load_model("smollm2", progress=False)
    ids = lm.tokenize(load_text("license:GPL-3"))[: args.prefix + 16]
    recompute, _ = ttft(TransformersKVHook(lm, KVStore([MemoryTier(None)], model=lm.model_id, codec="raw"),
                                           save=False), ids, args.reps)
    print(f"store_link: recompute {recompute:.2f} s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        server = started_redis(Path(folder))
        try:
            rows += measure(lm, ids, args.prefix, server, None, None, args.reps)
        finally:
            server.stop()
        for rate in (float(r) for r in args.rates.split(",")):
            with ShapedLink(rate) as link:
                server = started_redis(Path(folder), link)
                try:
                    rows += measure(lm, ids, args.prefix, server, link, rate, args.reps)
                finally:
                    server.stop()
    write(rows, recompute, args)


def write(rows: list[dict], recompute: float, args: argparse.Namespace) -> None:
    lines = [
        "# Time to first token from Redis behind a shaped link (transformers hook, SmolLM2-135M-Instruct, CPU)",
        "",
        f"A {args.prefix}-token prefix of license:GPL-3 stored in Redis, then a request for it plus 16 new tokens; "
        "Redis in a network namespace behind tbf at each rate (both directions), or on loopback (unshaped). "
        f"Median of {args.reps} runs (one where a raw load takes over 20 s). Produced by "
        f"`python bench/store_link.py --prefix {args.prefix} --rates {args.rates} --reps {args.reps}`.",
        "",
        f"Recomputing the prefix: **{recompute:.2f} s**.",
        "",
        "| link | codec | bytes fetched | time to first token | vs recompute |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        link = "unshaped (loopback)" if r["rate"] is None else f"{r['rate']:g} Mbit/s"
        lines.append(f"| {link} | {r['codec']} | {r['bytes'] / 1e6:.2f} MB | {r['ttft_s']:.2f} s | "
                     f"{recompute / r['ttft_s']:.2f}x sooner |" if r["ttft_s"] < recompute else
                     f"| {link} | {r['codec']} | {r['bytes'] / 1e6:.2f} MB | {r['ttft_s']:.2f} s | "
                     f"{r['ttft_s'] / recompute:.2f}x later |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
