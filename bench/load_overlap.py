"""Does a store load overlap fetch with decode?  Fetch alone, decode alone and the streamed load, side by side.

Real SmolLM2 KV of a ``--tokens``-token prefix of ``license:GPL-3`` (float16), stored as 256-token chunks in a
real ``redis-server`` on loopback (unshaped).  Per codec, the median of ``--reps`` runs of:

- fetch: ``KVStore.fetch`` of every chunk (reads and checks, nothing decoded);
- decode: every fetched chunk decoded into vLLM's CPU paged layout, one after the other, nothing fetched;
- load: :meth:`~kvcodec.store.KVStore.prefix_load` into the same paged memory: fetch of chunk ``i+1`` overlapping the
  decode of chunk ``i``.

The target (issue 18): a load takes at most max(fetch, decode) + 20%.  Beside each compressed codec, "raw fetch
beside its decode": the raw chunks fetched while another thread decodes that codec's chunks over and over (what a
load from both ends does, kvcodec.store.plan), against raw's fetch alone: on a machine whose cores also run Redis
and the network path, a decode slows the fetch.  kvtc uses a small calibration made here
(1024 tokens, one basis per layer: seconds), so its rate and speed are close to, not exactly, the default's.
Writes ``bench/results/load_overlap.md``.

    python bench/load_overlap.py [--tokens 2048] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvcodec.layouts.paged import empty_shape
from kvcodec.store import KVStore, PagedSink, RedisTier
from kvcodec.store.load import decode_chunk_into
from kvcodec.models import load_model
from kvcodec.tools.redis_server import started_redis
from kvcodec.texts import load_text

OUT = Path(__file__).parent / "results" / "load_overlap.md"
BLOCK = 128


def paged_sink(kv, tokens: int) -> PagedSink:
    shape = kv.shapes[0]
    blocks = -(-tokens // BLOCK)
    layers = [torch.zeros(empty_shape("cpu", blocks, BLOCK, shape.heads, shape.key_dim), dtype=kv.dtype)
              for _ in range(kv.num_layers)]
    return PagedSink(layers, list(range(blocks)), BLOCK, "cpu")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def raw_fetch_beside(raw_store: KVStore, store: KVStore, ids: list[int], reps: int) -> float:
    """Median seconds to fetch every raw chunk while another thread keeps decoding ``store``'s chunks."""
    chunks = store.fetch(ids)
    stop = threading.Event()

    def decode() -> None:
        while not stop.is_set():
            for c in chunks:
                store.decode_chunk(c)

    worker = threading.Thread(target=decode, daemon=True)
    worker.start()
    time.sleep(0.05)  # the decoder is under way
    try:
        return statistics.median(timed(lambda: raw_store.fetch(ids)) for _ in range(reps))
    finally:
        stop.set()
        worker.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--codecs", default="raw,cachegen,kvtc")
    args = ap.parse_args()
    lm = load_model("smollm2", progress=False)
    ids = lm.tokenize(load_text("license:GPL-3"))[: args.tokens]
    kv = lm.prefill(ids, dtype=torch.float16)
    rows = []
    raw_store = None
    with tempfile.TemporaryDirectory() as folder:
        server = started_redis(Path(folder))
        try:
            for codec in args.codecs.split(","):
                options = {}
                if codec == "kvtc":
                    from kvcodec.codecs.kvtc import register_calibration
                    from kvcodec.codecs.kvtc.fit import calibrate

                    cal = register_calibration(calibrate(lm, max_tokens=1024, segment_tokens=512, group_layers=1))
                    options = {"calibration": cal.digest}
                store = KVStore([RedisTier(server.host, server.port, timeout_s=30.0)], model=lm.model_id,
                                codec=codec, codec_options=options)
                store.put(ids, kv)
                fetch, decode, load, nbytes = [], [], [], 0
                for _ in range(args.reps):
                    chunks: list = []
                    fetch.append(timed(lambda: chunks.extend(store.fetch(ids))))
                    nbytes = sum(len(c.data) for c in chunks)
                    sink = paged_sink(kv, len(ids))
                    decode.append(timed(lambda: [decode_chunk_into(store, c, sink, 0, len(ids)) for c in chunks]))
                    sink = paged_sink(kv, len(ids))
                    load.append(timed(lambda: store.prefix_load(ids, sink).start().finish()))
                f, d, l = (statistics.median(x) for x in (fetch, decode, load))
                beside = raw_fetch_beside(raw_store, store, ids, args.reps) if raw_store and codec != "raw" else None
                rows.append((codec, nbytes, f, d, l, beside))
                print(f"load_overlap: {codec}: fetch {f:.3f} s, decode {d:.3f} s, load {l:.3f} s "
                      f"({l / max(f, d):.2f}x max, {l / (f + d):.2f}x sum)"
                      + (f", raw fetch beside its decode {beside:.3f} s" if beside else ""), flush=True)
                if codec == "raw":
                    raw_store = store
                else:
                    store.evict(ids)
        finally:
            server.stop()
    lines = [f"# Streamed loads: fetch and decode overlap ({args.tokens} tokens, Redis on loopback)", "",
             f"`python bench/load_overlap.py --tokens {args.tokens} --reps {args.reps}` on {time.strftime('%Y-%m-%d')}: "
             "real SmolLM2-135M float16 KV in 256-token chunks; medians. Decode is into vLLM's CPU paged layout "
             "(block 128). Target: load <= 1.2 x max(fetch, decode).", "",
             "| codec | bytes | fetch s | decode s | load s | load / max(fetch, decode) | load / (fetch + decode) "
             "| raw fetch beside its decode |",
             "|---|---|---|---|---|---|---|---|"]
    raw_fetch = next((f for codec, _, f, *_ in rows if codec == "raw"), None)
    for codec, nbytes, f, d, l, beside in rows:
        slowed = f"{beside:.3f} s ({beside / raw_fetch:.1f}x raw's alone)" if beside and raw_fetch else ""
        lines.append(f"| {codec} | {nbytes:,} | {f:.3f} | {d:.3f} | {l:.3f} | {l / max(f, d):.2f} | {l / (f + d):.2f} "
                     f"| {slowed} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
