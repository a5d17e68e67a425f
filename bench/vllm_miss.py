"""A miss's time to first token inside vLLM (its CPU build) when the connector saves the prompt into Redis behind a
real shaped link, against vLLM without the connector: does the save delay the reply, or the next request?

Runs as root in ``.venv-engines`` (``bash scripts/setup_engines.sh``)::

    .venv-engines/bin/python bench/vllm_miss.py [--links 100,1000,unshaped] [--codec raw] [--rounds 3] [--tokens 2048]

Per link (Redis in a network namespace behind tbf on a veth pair, ``kvcodec/tools/netlab.py``): a fresh engine
without the connector and a fresh one with it (``--codec``, Redis its only tier) each answer a first request, a miss;
then ``--rounds`` interleaved rounds, in each of which every engine answers two misses sent one right after the
other ("miss", then "next", which runs while the first one's save is under way). Each request is the first
``--tokens`` tokens of ``license:GPL-3`` and one generated token under a ``cache_salt`` of its own, so each misses
and is saved. The bench waits for every save (the connector's log line) before the next round and reports its
seconds, from that line. Ratios are the connector engine's time over the plain engine's: the fastest of the rounds
and the median of the rounds' own ratios. Writes ``bench/results/vllm_miss.md`` (``--out``) and a ``.json`` beside.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import redis
from prompts import vllm_prompt  # bench/ is on sys.path when this runs as a script

from kvcodec.tools.harness import wait_until
from kvcodec.tools.harness.vllm_server import DTYPE, Engine, connector_config
from kvcodec.tools.netlab import ShapedLink, unavailable
from kvcodec.tools.redis_server import started_redis

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "vllm_miss"
UNSHAPED = 100_000  # tbf at 100 Gbit/s never holds a packet back: the veth and Redis set the pace
SAVED = re.compile(r"saved (\d+) new chunk\(s\) of tokens 0-(\d+) in ([\d.]+) s, (\d+) bytes")
LOADED = re.compile(r"loaded tokens (\d+)-(\d+) of \d+-\d+ in [\d.]+ s")


def rate(link: str) -> float:
    return UNSHAPED if link == "unshaped" else float(link)


def saves(engine: Engine) -> list[tuple[float, int]]:
    """Each save the connector logged so far: its seconds and bytes."""
    return [(float(m.group(3)), int(m.group(4))) for line in engine.grep("kvcodec connector: request")
            if (m := SAVED.search(line))]


def pair(engine: Engine, prompt: list[int], salt: str) -> tuple[float, float]:
    """Two misses sent one right after the other: the seconds of each."""
    first = engine.generate(prompt, 1, cache_salt=salt)
    second = engine.generate(prompt, 1, cache_salt=salt + "-next")
    assert first["num_cached_tokens"] == 0 == second["num_cached_tokens"], (first, second)
    return first["seconds"], second["seconds"]


def hit(ours: Engine, prompt: list[int], salt: str, seconds: list[float], loaded: list[float]) -> None:
    """A request for a stored prompt: its seconds, and the tokens the connector loaded (its log line; none where the
    scheduler left the prompt to vLLM, which computes what was not loaded)."""
    before = len(load_lines(ours))
    reply = ours.generate(prompt, 1, cache_salt=salt)
    new = load_lines(ours)[before:]
    seconds.append(reply["seconds"])
    loaded.append(int(new[-1].group(2)) - int(new[-1].group(1)) if new else 0)


def load_lines(engine: Engine) -> list[re.Match]:
    return [m for line in engine.grep("kvcodec connector: request") if (m := LOADED.search(line))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--links", default="100,1000,unshaped", help="Mbit/s rates (or 'unshaped'), comma-separated")
    p.add_argument("--codec", default="raw", help="the connector's codec (a spec, or variants comma-separated)")
    p.add_argument("--rounds", type=int, default=3, help="warm rounds per link (default 3)")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--out", type=Path, default=OUT.with_suffix(".md"), help="the table (and a .json beside it)")
    args = p.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"vllm_miss: {why}")
    model, prompt, _ = vllm_prompt(args.tokens)
    codec = args.codec.split(",") if "," in args.codec else args.codec
    rows = []
    with ShapedLink(UNSHAPED) as link, tempfile.TemporaryDirectory(prefix="kvcodec-vllm-miss-") as folder:
        server = started_redis(Path(folder), link)
        try:
            extra = {"codec": codec, "tiers": [f"{server.url}?timeout=120"]}
            for name in args.links.split(","):
                redis.Redis.from_url(server.url).flushall()  # every request below misses anyway
                link.set_rate(rate(name))
                rows.append(measure(name, model, prompt, extra, args.rounds))
                print(f"vllm_miss: {rows[-1]}", flush=True)
                write(rows, args)
        finally:
            server.stop()


def measure(link: str, model: Path, prompt: list[int], extra: dict, rounds: int) -> dict:
    with Engine(model) as plain, Engine(model, connector_config(**extra)) as ours:
        first = {"plain": plain.generate(prompt, 1, cache_salt=f"{link}-first")["seconds"],
                 "ours": ours.generate(prompt, 1, cache_salt=f"{link}-first")["seconds"]}
        wait_until("the first save", lambda: len(saves(ours)) == 1, 600)
        runs: dict[str, list[tuple[float, float]]] = {"plain": [], "ours": []}
        for r in range(rounds):
            runs["plain"].append(pair(plain, prompt, f"{link}-{r}"))
            runs["ours"].append(pair(ours, prompt, f"{link}-{r}"))
            wait_until("the round's saves", lambda: len(saves(ours)) == 3 + 2 * r, 600)
        logged = saves(ours)
        hits = hit_beside_a_save(ours, prompt, link, rounds)
    ratio = {k: [o[i] / p[i] for o, p in zip(runs["ours"], runs["plain"])] for i, k in enumerate(("miss", "next"))}
    return {"link": link, "first_plain_s": first["plain"], "first_ours_s": first["ours"], "runs": runs,
            "miss_fastest": min(o for o, _ in runs["ours"]) / min(p for p, _ in runs["plain"]),
            "next_fastest": min(o for _, o in runs["ours"]) / min(p for _, p in runs["plain"]),
            "miss_median": statistics.median(ratio["miss"]), "next_median": statistics.median(ratio["next"]),
            "save_s": statistics.median(s for s, _ in logged), "save_mb": statistics.median(b for _, b in logged) / 1e6,
            "hits": hits}


def hit_beside_a_save(ours: Engine, prompt: list[int], link: str, rounds: int) -> dict[str, list[float]]:
    """A stored prompt's hit alone, and right after a miss whose save shares the link with its load (the same
    tokens under another salt: the hit never waits for that save), each round; seconds."""
    saved = len(saves(ours))
    ours.generate(prompt, 1, cache_salt=f"{link}-hit")
    wait_until("the hit's prompt saved", lambda: len(saves(ours)) == saved + 1, 600)
    out: dict[str, list[float]] = {k: [] for k in ("alone", "beside", "alone_loaded", "beside_loaded")}
    for r in range(rounds):
        hit(ours, prompt, f"{link}-hit", out["alone"], out["alone_loaded"])
        ours.generate(prompt, 1, cache_salt=f"{link}-beside-{r}")  # a miss: its save starts behind the reply
        hit(ours, prompt, f"{link}-hit", out["beside"], out["beside_loaded"])
        wait_until("the round's save", lambda: len(saves(ours)) == saved + 2 + r, 600)
    return out


def write(rows: list[dict], args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    saved = {"args": {**vars(args), "out": str(args.out)}, "dtype": DTYPE, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(saved, indent=1))
    out = "" if args.out == OUT.with_suffix(".md") else f" --out {args.out}"
    lines = [f"# A miss inside vLLM while the connector saves it behind a shaped link ({args.codec})", "",
             f"`python bench/vllm_miss.py --links {args.links} --codec {args.codec} --rounds {args.rounds} --tokens "
             f"{args.tokens}{out}`, {time.strftime('%Y-%m-%d')}: SmolLM2 {DTYPE}, vLLM CPU, Redis behind tbf. The "
             "connector engine's time over vLLM's without the connector: a fresh engine's first request, then the "
             "fastest of the rounds (the median of the rounds' own ratios in brackets). \"next\": a second miss sent "
             "right after the first, while its save runs. The save's own seconds are from the connector's log.", "",
             "A hit: the prompt loaded under a salt it was saved with, alone, and right after a miss whose save "
             "shares the link with its load (seconds, the fastest of the rounds; the median of the rounds' own "
             "ratios and the median tokens the connector loaded in brackets: vLLM computes the rest, where the load "
             "planner found that sooner).", "",
             "| link (Mbit/s) | fresh engine's first | miss | next | plain prefill (s, fastest) | save (s) | "
             "save (MB) | hit alone (s) | hit beside a save (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h = r["hits"]
        ratios = [b / a for a, b in zip(h["alone"], h["beside"])]
        lines.append(f"| {r['link']} | {r['first_ours_s'] / r['first_plain_s']:.2f} ({r['first_ours_s']:.2f} s "
                     f"against {r['first_plain_s']:.2f} s) | {r['miss_fastest']:.2f} ({r['miss_median']:.2f}) | "
                     f"{r['next_fastest']:.2f} ({r['next_median']:.2f}) | "
                     f"{min(p for p, _ in r['runs']['plain']):.2f} | {r['save_s']:.2f} | {r['save_mb']:.1f} | "
                     f"{min(h['alone']):.2f} ({statistics.median(h['alone_loaded']):.0f} loaded) | "
                     f"{min(h['beside']):.2f} ({statistics.median(ratios):.2f}x; "
                     f"{statistics.median(h['beside_loaded']):.0f} loaded) |")
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
