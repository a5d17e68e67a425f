"""Time to first token inside vLLM (its CPU build) whose store is Redis behind a real shaped link.

Runs as root in ``.venv-engines`` (``bash scripts/setup_engines.sh``)::

    .venv-engines/bin/python bench/vllm_link.py [--tokens 2048] [--rates 10,100,1000,10000]

Redis runs in a network namespace reached over a veth pair shaped with tbf (``kvcodec/tools/netlab.py``) at each rate,
and at 100 Gbit/s for the "unshaped" row (tbf then never holds a packet back: the veth and Redis set the pace).
One vLLM engine per strategy: without the connector (recompute), with each fixed codec, and adaptive (the store
keeps every variant; :mod:`kvcodec.store.plan` picks each chunk's, or stops and lets vLLM recompute).  Per
engine the prompt (the first ``--tokens`` tokens of ``license:GPL-3``) is saved once at full speed, then at each
rate the same prompt is asked for with one generated token (its wall time is the time to first token), ``--reps``
times after one unmeasured request at that rate (the adaptive store learns the link from its own reads, as in
serving); the table shows the median and the spread.  "drop":
the link runs at 1 Gbit/s and falls to 20 Mbit/s ``--drop-after`` seconds into the request.  Bytes moved and the
variants used come from the connector's log line for the request.  Writes ``bench/results/vllm_link.md``/``.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
from pathlib import Path

from prompts import vllm_prompt  # bench/ is on sys.path when this runs as a script

from kvcodec.tools.harness.vllm_server import Engine, connector_config
from kvcodec.tools.netlab import ShapedLink, unavailable
from kvcodec.tools.redis_server import started_redis

REPO = Path(__file__).resolve().parent.parent

OUT = REPO / "bench" / "results" / "vllm_link"
UNSHAPED = 100_000
# a small kvtc calibration (seconds to make; the default one takes minutes here): kvtc's quality in this table is
# that calibration's, its rate close to the default's
CALIBRATION = {"max_tokens": 1024, "segment_tokens": 512, "group_layers": 1}
STRATEGIES = {"raw": "raw", "cachegen": "cachegen", "kvtc": "kvtc", "adaptive": ["kvtc", "cachegen", "raw"]}
LOADED = re.compile(r"loaded tokens (\d+)-(\d+) of (\d+)-(\d+) in ([\d.]+) s, (\d+) bytes, variants \[(.*)\]")


def last_load(engine: Engine) -> dict:
    """What the connector's log says of the last request's load."""
    lines = engine.grep("kvcodec connector: request")
    hit = next((LOADED.search(line) for line in reversed(lines) if LOADED.search(line)), None)
    if hit is None:
        return {"loaded": 0, "bytes": 0, "variants": ""}
    variants = [v.strip(" '") for v in hit.group(7).split(",") if v.strip()]
    counts = {v: variants.count(v) for v in dict.fromkeys(variants)}
    return {"loaded": int(hit.group(2)) - int(hit.group(1)), "bytes": int(hit.group(6)),
            "variants": " ".join(f"{v}x{n}" for v, n in counts.items())}


def request(engine: Engine, ids: list[int], link: ShapedLink, rate: float | None, drop_after: float | None,
            reps: int) -> dict:
    """``reps`` requests for ``ids`` at ``rate`` (None: vLLM recomputes), after one unmeasured at the same rate, so
    that the store has learnt the link from its own reads as in serving; with ``drop_after``, each at 1 Gbit/s
    falling to 20 Mbit/s that many seconds in, after one unmeasured at 1 Gbit/s.  The median request's row, with
    every time in ``ttft_all``."""
    runs, warm = [], int(drop_after is None)
    for i in range(reps + warm):
        link.set_rate(1000 if drop_after is not None else rate or UNSHAPED)
        if drop_after is not None:  # each dropping request comes after one at 1 Gbit/s, not after the last drop
            engine.generate(ids, 1)
        dropper = None if drop_after is None else threading.Timer(drop_after, link.set_rate, (20,))
        if dropper is not None:
            dropper.start()
        reply = engine.generate(ids, 1, timeout_s=1800)
        if dropper is not None:
            dropper.join()
        if i >= warm:
            runs.append({"ttft_s": reply["seconds"], **(last_load(engine) if rate is not None else
                                                       {"loaded": 0, "bytes": 0, "variants": ""})})
    runs.sort(key=lambda r: r["ttft_s"])
    return {**runs[len(runs) // 2], "ttft_all": [r["ttft_s"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rates", default="10,100,1000,10000", help="Mbit/s, comma-separated (plus unshaped)")
    ap.add_argument("--drop-after", type=float, default=0.3, help="seconds into the request the link drops")
    ap.add_argument("--strategies", default=",".join(["recompute", *STRATEGIES]))
    ap.add_argument("--keep", action="store_true", help="keep the other strategies' rows of the last run's JSON")
    ap.add_argument("--reps", type=int, default=3, help="measured requests per cell (the median is shown)")
    args = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"vllm_link: {why}")
    model, prompt, warmup = vllm_prompt(args.tokens)
    rates: list[float | str] = [float(r) for r in args.rates.split(",")] + ["unshaped", "drop"]
    rows = []
    work = Path(tempfile.mkdtemp(prefix="kvcodec-vllm-link-"))
    with ShapedLink(UNSHAPED) as link:
        redis = started_redis(work, link)
        try:
            for name in args.strategies.split(","):
                extra = None if name == "recompute" else {
                    "codec": STRATEGIES[name], "tiers": [f"{redis.url}?timeout=120"],
                    "calibration_options": CALIBRATION}
                print(f"vllm_link: starting vLLM, {name}", flush=True)
                # kvtc's calibration is made for this run, in a cache folder of its own
                with Engine(model, None if extra is None else connector_config(**extra),
                            env={"XDG_CACHE_HOME": str(work / "cache")}) as engine:
                    engine.generate(warmup, 1)
                    link.set_rate(UNSHAPED)
                    engine.generate(prompt, 1)  # saved (a miss), at full speed
                    for rate in rates:
                        got = request(engine, prompt, link,
                                      None if name == "recompute" else UNSHAPED if isinstance(rate, str) else rate,
                                      args.drop_after if rate == "drop" else None, args.reps)
                        row = {"strategy": name, "rate": rate, **got}
                        rows.append(row)
                        print(f"vllm_link: {name} at {rate}: {got['ttft_s']:.2f} s (of "
                              f"{', '.join(f'{t:.2f}' for t in got['ttft_all'])}), {got['bytes'] / 1e6:.1f} MB, "
                              f"{got['loaded']} tokens loaded {got['variants']}", flush=True)
        finally:
            redis.stop()
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    kept = []
    if args.keep and OUT.with_suffix(".json").exists():
        ran = {r["strategy"] for r in rows}
        kept = [r for r in json.loads(OUT.with_suffix(".json").read_text()) if r["strategy"] not in ran]
    rows = kept + rows
    OUT.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    cell = {(r["strategy"], r["rate"]): r for r in rows}

    def label(rate: float | str) -> str:
        return rate if isinstance(rate, str) else f"{rate:g} Mbit/s"

    lines = [f"# Time to first token in vLLM from Redis over a shaped link ({args.tokens}-token prompt)", "",
             f"`python bench/vllm_link.py --tokens {args.tokens} --rates {args.rates} --reps {args.reps}` on "
             f"{time.strftime('%Y-%m-%d')}: vLLM CPU 0.32.0, SmolLM2-135M-Instruct in float32, one engine per "
             f"strategy, Redis in a network namespace behind tbf on a veth pair. Seconds to the first token: the "
             f"median of {args.reps} requests after one unmeasured at the same rate, the fastest and slowest in "
             "brackets; below each, the median request's MB moved and the variants loaded."
             + (f" Rows of {', '.join(sorted({r['strategy'] for r in kept}))} are from the previous run (--keep)."
                if kept else ""), "",
             "| strategy | " + " | ".join(label(r) for r in rates) + " |", "|---" * (len(rates) + 1) + "|"]
    for name in names:
        cells = []
        for rate in rates:
            r = cell.get((name, rate))
            if r is None:
                cells.append("")
                continue
            extra = "" if name == "recompute" else f"<br>{r['bytes'] / 1e6:.1f} MB, {r['loaded']} tok"
            if name == "adaptive" and r["variants"]:
                extra += f"<br>{r['variants']}"
            spread = r.get("ttft_all", [])
            spread = f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else ""
            cells.append(f"{r['ttft_s']:.2f} s{spread}{extra}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
