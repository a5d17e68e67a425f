"""LMCache store and retrieve throughput with kvcodec's remote storage plugin against LMCache's own local disk
backend, on a real ``LMCacheEngine`` on the CPU.

Runs in ``.venv-engines`` (``bash scripts/setup_engines.sh``)::

    .venv-engines/bin/python bench/lmcache_io.py [--tokens 2048] [--reps 3]

The KV is real: SmolLM2's float16 cache over the first ``--tokens`` tokens of ``license:GPL-3`` (``kvcodec dump``),
in LMCache's ``[2, L, T, H*D]`` layout.  Store = ``LMCacheEngine.store`` until every chunk's write has finished
(LMCache writes in the background); retrieve = ``LMCacheEngine.retrieve`` of all of it, in a new engine for the
plugin (nothing in memory) and in the same engine for LMCache's local disk backend (its index lives in the engine).
MB/s are of float16 KV; every configuration is measured in turn, ``--reps`` rounds, medians.
Writes ``bench/results/lmcache_io.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import redis as redis_py
import torch
from real_kv import gpl3_kv  # bench/ is on sys.path when this runs as a script

from kvcodec.tools.harness.lmcache_engine import CPUEngine, kvcodec_plugin_config, local_disk_config
from kvcodec.tools.redis_server import started_redis

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "lmcache_io"


def real_kv(tokens: int) -> tuple[list[int], torch.Tensor]:
    """The token ids and LMCache-layout KV (``[2, L, T, H*D]``) of the benches' real cache."""
    kv = gpl3_kv(tokens)
    return list(kv.token_ids), kv.to_lmcache()


def run(name: str, config: dict, tokens: list[int], kv: torch.Tensor, new_engine_for_retrieve: bool) -> dict:
    L, H, D = kv.shape[1], 3, kv.shape[3] // 3
    make = lambda: CPUEngine(config, layers=L, heads=H, head_dim=D, dtype=kv.dtype)  # noqa: E731
    first = make()
    try:
        start = time.perf_counter()
        first.store(tokens, kv)
        first.settle()
        store_s = time.perf_counter() - start
        stored = first.remote_connector().stats["bytes_out"] if "plugin" in name else None
        if new_engine_for_retrieve:
            first.close()
            first = make()
        start = time.perf_counter()
        got, n = first.retrieve(tokens, kv)
        retrieve_s = time.perf_counter() - start
    finally:
        first.close()
    assert n == len(tokens), f"{name}: retrieved {n} of {len(tokens)} tokens"
    exact = bool(torch.equal(got, kv))
    return {"name": name, "store_s": store_s, "retrieve_s": retrieve_s, "stored_bytes": stored, "bit_exact": exact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tokens, kv = real_kv(args.tokens)
    mb = kv.numel() * kv.element_size() / 1e6
    work = Path(tempfile.mkdtemp(prefix="kvcodec-lmcache-io-"))
    redis = started_redis(work)
    redis_url = redis.url.replace("redis://", "kvcodec://")
    configs = [("LMCache local disk", lambda i: local_disk_config(f"{work}/lmcache-disk-{i}"), False)]
    for codec in ("raw", "cachegen", "kvfetcher"):
        configs.append((f"plugin {codec}, disk",
                        lambda i, c=codec: kvcodec_plugin_config(f"kvcodec://{work}/plugin-{c}-{i}?backend=disk&codec={c}"),
                        True))
        configs.append((f"plugin {codec}, Redis",
                        lambda i, c=codec: kvcodec_plugin_config(f"{redis_url}/{i}?backend=redis&codec={c}"), True))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    try:
        for i in range(args.reps):
            for name, config, new_engine in configs:
                if "Redis" in name:
                    redis_py.Redis(port=redis.port).flushall()
                r = run(name, config(i), tokens, kv, new_engine)
                results[name].append(r)
                print(f"lmcache_io: round {i + 1}: {r}", flush=True)
    finally:
        redis.stop()
    rows = []
    for name, runs in results.items():
        store_s = statistics.median(r["store_s"] for r in runs)
        retrieve_s = statistics.median(r["retrieve_s"] for r in runs)
        stored = runs[0]["stored_bytes"]
        rows.append({"name": name, "store_MBps": mb / store_s, "retrieve_MBps": mb / retrieve_s, "store_s": store_s,
                     "retrieve_s": retrieve_s, "stored_MB": None if stored is None else stored / 1e6,
                     "bit_exact": all(r["bit_exact"] for r in runs)})
    write(rows, mb, args)


def write(rows: list[dict], mb: float, args: argparse.Namespace) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"kv_MB": mb, "tokens": args.tokens, "rows": rows}, indent=1))
    base = rows[0]
    lines = ["# LMCache store and retrieve throughput: kvcodec's plugin vs LMCache's local disk backend", "",
             f"A real `LMCacheEngine` (LMCache 0.5.6) on the CPU, {args.tokens} tokens of real SmolLM2 float16 KV "
             f"({mb:.1f} MB, 256-token chunks); medians of {args.reps} rounds on a shared 2-core machine. "
             "Produced by `.venv-engines/bin/python bench/lmcache_io.py`.", "",
             "| backend | store MB/s | retrieve MB/s | store vs LMCache disk | retrieve vs LMCache disk | stored MB "
             "| retrieved bit-exact |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        stored = "-" if r["stored_MB"] is None else f"{r['stored_MB']:.2f}"
        lines.append(f"| {r['name']} | {r['store_MBps']:.0f} | {r['retrieve_MBps']:.0f} "
                     f"| {r['store_MBps'] / base['store_MBps']:.2f}x | {r['retrieve_MBps'] / base['retrieve_MBps']:.2f}x "
                     f"| {stored} | {'yes' if r['bit_exact'] else 'no (lossy codec)'} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
