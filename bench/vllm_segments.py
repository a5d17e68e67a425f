"""Segment reuse with selective recompute inside vLLM (its CPU build; issue 34, item 4): time to first token and
quality of fused prompts against vLLM's own full prefill and against prefix-only reuse (SmolLM2, float32).

The prompts are segment_reuse.py's (the model's BOS, a system text, ``--docs`` real documents of ``--doc-tokens`` in
shuffled orders, a question).  Three engines run side by side, idle but for the request at hand:

- vLLM without the connector: the full prefill, the reference;
- vLLM with kvcodec's connector (``raw`` in a disk folder, the segments stored once by a request each with
  ``store_segment``): fusion at ``--shares`` (``auto``: the loading controller's), and prefix-only reuse (the
  connector serving the prompt without segment parameters, under a ``cache_salt`` per round so that it finds only
  the prompts before it, saved the same way, never itself);
- vLLM with the connector storing ``cachegen`` (level 2): the prompt with the continuation saved once, then loaded:
  the full prefill's own KV through the lossy codec, the issue's yardstick for quality.

Time to first token: a request for one token, ``--reps`` rounds interleaved, the fastest of each and the median of
the rounds' ratios to the full prefill; then a fresh engine's first request (``--fresh`` starts of each, one after
another, nothing else running): vLLM without the connector prefilling the first prompt, and vLLM with the connector
on the same disk folder fusing it at the loading controller's share.  Quality: the reference's 32-token greedy
continuation appended to the prompt, teacher-forced, and each method's log-probabilities of its positions (vLLM's
``prompt_logprobs``, top 20): the KL divergence from the reference over the reference's top 20 tokens (the rest of
the vocabulary left out), and how often the two agree on the most likely token.  (A fusion's timed requests get
the segments from the connector to the token; its quality requests, which ask for prompt log-probabilities, whole
blocks: see kvcodec/engines/vllm_connector/scheduler.py.)

With ``--link MBIT`` the connector's tier is Redis in a network namespace behind tbf on a veth pair
(``kvcodec.tools.netlab``, root only) instead of the disk folder: the segments are stored at full speed, then the
link runs at ``MBIT`` for every timed request, fresh engines' included (prefix-only reuse then also saves each
round's prompt over it, as the connector saves before the step ends).  ``--codec`` is what the connector stores
(``cachegen,raw``: both, the load picking per chunk).

    python bench/vllm_segments.py [--docs 8] [--doc-tokens 490] [--prompts 2] [--shares 0,0.15,0.3,auto] [--reps 3]
                                  [--fresh 2] [--link MBIT] [--codec raw]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import tempfile
from pathlib import Path

from prompts import REPO
from segment_reuse import DOCS, QUESTIONS, SYSTEM
from tqdm import tqdm

from kvcodec.tools.harness.vllm_server import DTYPE, Engine, connector_config
from kvcodec.tools.netlab import ShapedLink, unavailable
from kvcodec.tools.redis_server import started_redis

OUT = REPO / "bench" / "results" / "vllm_segments.md"
CONTINUATION = 32
TOP = 20


def parse_shares(text: str) -> list[float | None]:
    return [None if s == "auto" else float(s) for s in text.split(",")]


def name(share: float | None) -> str:
    return "fusion, the controller's share" if share is None else f"fusion {share:.0%}"


def divergence(got: list, want: list, ids: list[int], start: int) -> tuple[float, float]:
    """Mean KL over the reference's top tokens, and top-1 agreement, from position ``start`` on."""
    as_dict = lambda p: {int(t): x for t, x in p.items()}  # noqa: E731
    kls, agree = [], []
    for i in range(start, len(ids)):
        g, w = as_dict(got[i]), as_dict(want[i])
        kls.append(sum(math.exp(w[t]) * (w[t] - g[t]) for t in w if t in g))
        agree.append(max(g, key=g.get) == max(w, key=w.get))
    return statistics.mean(kls), statistics.mean(agree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=8, help="documents per prompt (default 8)")
    ap.add_argument("--doc-tokens", type=int, default=490,
                    help="tokens per document (default 490: 3,850-token prompts)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts, each its own shuffled order (default 2)")
    ap.add_argument("--shares", default="0,0.15,0.3,auto", help="recompute shares; auto: the loading controller's")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds of time to first token (default 3)")
    ap.add_argument("--fresh", type=int, default=2,
                    help="fresh engines of each kind timed on their first request (default 2; 0: none)")
    ap.add_argument("--link", type=float, metavar="MBIT", default=None,
                    help="the connector's store in Redis behind a shaped link of MBIT Mbit/s (default: a disk folder)")
    ap.add_argument("--codec", default="raw", help="what the connector stores: a codec, or several separated by "
                                                   "commas for a load to choose from (default raw)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"the result table (default {OUT.relative_to(REPO)})")
    args = ap.parse_args()
    shares = parse_shares(args.shares)
    if args.link is not None and (why := unavailable()):
        ap.error(f"--link: {why}")
    with contextlib.ExitStack() as stack:
        run(args, shares, stack)


def connector_tier(args, stack: contextlib.ExitStack):
    """The connector's tier (a disk folder, or Redis behind ``--link``, unshaped until :meth:`ShapedLink.set_rate`)
    and the link (None for the folder)."""
    if args.link is None:
        return f"disk:{tempfile.mkdtemp()}", None
    link = stack.enter_context(ShapedLink(100_000))
    redis = started_redis(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcodec-vllm-segments-"))),
                          link)
    stack.callback(redis.stop)
    # a raw 256-token chunk of SmolLM2 float32 KV is 11.8 MB: about 1 s at 100 Mbit/s
    return f"{redis.url}?timeout=60", link


def run(args, shares: list[float | None], stack: contextlib.ExitStack) -> None:
    from transformers import AutoTokenizer

    from kvcodec.texts import load_text
    from kvcodec.tools.models import export_hf_folder

    model = Path(export_hf_folder("smollm2", REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"))
    tk = AutoTokenizer.from_pretrained(model)
    tok = lambda s: tk(s, add_special_tokens=False).input_ids  # noqa: E731
    system = tok(SYSTEM)
    docs = [tok(load_text(spec)[:args.doc_tokens * 8])[:args.doc_tokens] for spec in DOCS[:args.docs]]
    rng = random.Random(0)
    prompts = []
    for p in range(args.prompts):
        order = list(range(args.docs))
        rng.shuffle(order)
        segments = [system] + [docs[i] for i in order]
        prompts.append((segments, tok(QUESTIONS[p % len(QUESTIONS)])))
    bos = tk.bos_token_id
    methods = ["full prefill"] + [name(s) for s in shares] + ["prefix-only reuse"]
    times: dict[str, list[list[float]]] = {m: [] for m in methods}
    lossy = "cachegen level 2 (the full prefill's KV)"
    quality: dict[str, list[tuple[float, float]]] = {m: [] for m in methods[1:] + [lossy]}
    cached: dict[str, list[int]] = {m: [] for m in methods}
    tier, link = connector_tier(args, stack)
    codec = args.codec.split(",") if "," in args.codec else args.codec
    ours_config = connector_config(codec=codec, tiers=[tier])
    with Engine(model) as full, \
            Engine(model, ours_config) as ours, \
            Engine(model, connector_config(codec="cachegen:level=2", tiers=[f"disk:{tempfile.mkdtemp()}"])) as cg:
        for seg in tqdm([system] + docs, desc="storing segments", unit="doc"):
            ours.generate([bos] + seg, 1, kv_transfer_params={"kvcodec": {"store_segment": True}})
        # both engines' first long prompt pays one-time costs: a prompt of another text, as long, first
        warm = tok(load_text("license:GPL-3"))[:len(system) + sum(len(d) for d in docs)]
        full.generate([bos] + warm, 1)
        ours.generate([bos] + warm, 1, cache_salt="warm-up")
        if link is not None:
            link.set_rate(args.link)
        for p, (segments, question) in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
            context = [bos] + [t for s in segments for t in s]
            ids = context + question
            fused = lambda share: {"kvcodec": {"segments": [len(s) for s in segments],  # noqa: E731
                                               **({} if share is None else {"share": share})}}
            runs = {"full prefill": lambda r: full.generate(ids, 1),
                    # a salt per round: each round finds only the prompts before this one stored, not itself
                    "prefix-only reuse": lambda r: ours.generate(ids, 1, cache_salt=f"prefix-only-{r}")}
            for share in shares:
                runs[name(share)] = lambda r, share=share: ours.generate(ids, 1, kv_transfer_params=fused(share))
            rounds = {m: [] for m in methods}
            for r in range(args.reps):
                for m in methods:
                    got = runs[m](r)
                    rounds[m].append(got["seconds"])
                    if r == 0:
                        cached[m].append(got["num_cached_tokens"])
            for m in methods:
                times[m].append(rounds[m])
            greedy = full.generate(ids, CONTINUATION)["token_ids"]
            forced = ids + greedy
            ref = full.generate(forced, 1, prompt_logprobs=TOP)["prompt_logprobs"]
            for share in shares:
                got = ours.generate(forced, 1, prompt_logprobs=TOP, kv_transfer_params=fused(share))
                quality[name(share)].append(divergence(got["prompt_logprobs"], ref, forced, len(context)))
            cg.generate(forced, 1)  # saved in cachegen, then loaded: whole chunks, up to the question at least
            got = cg.generate(forced, 1, prompt_logprobs=TOP)
            assert got["num_cached_tokens"] >= len(context) // 256 * 256, got["num_cached_tokens"]
            quality[lossy].append(divergence(got["prompt_logprobs"], ref, forced, len(context)))
            fusions = ours.grep("fused ")
    # the first prompt as a fresh engine's first request; the tier holds the segments (and the salted prompts
    # prefix-only reuse saved, which this request's keys never name)
    segments, question = prompts[0]
    first_ids = [bos] + [t for s in segments for t in s] + question
    auto = {"kvcodec": {"segments": [len(s) for s in segments]}}
    first: dict[str, list[float]] = {"full prefill": [], "fusion, the controller's share": []}
    for _ in tqdm(range(args.fresh), desc="fresh engines", unit="pair"):
        with Engine(model) as fresh:
            first["full prefill"].append(fresh.generate(first_ids, 1)["seconds"])
        with Engine(model, ours_config) as fresh:
            first["fusion, the controller's share"].append(
                fresh.generate(first_ids, 1, kv_transfer_params=auto)["seconds"])
            fusions.append(fresh.grep("fused ")[-1])
    report(args, prompts, methods, times, quality, cached, fusions, first)


def tail(args) -> str:
    """The options that say where the segments were, as typed."""
    return (f" --link {args.link:g}" if args.link is not None else "") + \
        (f" --codec {args.codec}" if args.codec != "raw" else "")


def where(args) -> str:
    """Where and how the connector kept the segments, in words."""
    codec = " and ".join(args.codec.split(","))
    if args.link is None:
        return f"{codec} in a disk folder"
    return (f"{codec} in Redis in a network namespace behind tbf on a veth pair at {args.link:g} Mbit/s (stored at "
            "full speed; prefix-only reuse saves each round's prompt over the link)")


def report(args, prompts, methods, times, quality, cached, fusions, first) -> None:
    lengths = [1 + sum(len(s) for s in seg) + len(q) for seg, q in prompts]
    lines = [
        "# Segment reuse inside vLLM: time to first token and quality (SmolLM2, CPU)", "",
        f"`python bench/vllm_segments.py --docs {args.docs} --doc-tokens {args.doc_tokens} --prompts {args.prompts} "
        f"--shares {args.shares} --reps {args.reps} --fresh {args.fresh}{tail(args)}` (issue 34, item 4; "
        "[docs/segments.md](../../docs/segments.md)).",
        f"vLLM {DTYPE}, one CPU thread per engine; {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens "
        f"(the BOS, a system text, {args.docs} documents of {args.doc_tokens} tokens in shuffled orders, a question). "
        f"Segments stored {where(args)}, one request each. Time to first token: the engine's time for a "
        f"one-token request, {args.reps} rounds interleaved; the fastest of each prompt, then the median over "
        "prompts, and the median of every round's ratio to that round's full prefill. Quality: the full "
        f"prefill's {CONTINUATION}-token greedy continuation teacher-forced, KL over its top {TOP} tokens and "
        "top-1 agreement, means over prompts.", "",
        "| method | fastest TTFT (s) | fastest / full prefill's | median of the rounds' ratios | tokens from the "
        "connector | KL (top 20) | top-1 agreement |",
        "|---|---|---|---|---|---|---|"]
    full_best = [min(r) for r in times["full prefill"]]
    for m in methods + ["cachegen level 2 (the full prefill's KV)"]:
        if m not in times:
            q = quality[m]
            lines.append(f"| {m} | - | - | - | - | {statistics.mean(x for x, _ in q):.4f} | "
                         f"{statistics.mean(a for _, a in q):.3f} |")
            continue
        best = [min(r) for r in times[m]]
        ratios = [t / f for rounds, fr in zip(times[m], times["full prefill"]) for t, f in zip(rounds, fr)]
        q = quality.get(m)
        kl = f"{statistics.mean(x for x, _ in q):.4f}" if q else ("0" if m == "full prefill" else "-")
        agree = f"{statistics.mean(a for _, a in q):.3f}" if q else ("1.000" if m == "full prefill" else "-")
        lines.append(f"| {m} | {statistics.median(best):.3f} | "
                     f"{statistics.median(b / f for b, f in zip(best, full_best)):.2f} | "
                     f"{statistics.median(ratios):.2f} | {', '.join(map(str, cached[m]))} | {kl} | {agree} |")
    if args.fresh:
        lines += ["", f"A fresh engine's first request (the first prompt; {args.fresh} engine starts of each, one at a "
                  "time, nothing else running):", "",
                  "| method | first requests' TTFT (s) | / the fresh full prefills' (median) |", "|---|---|---|"]
        for m, got in first.items():
            ratio = statistics.median(t / f for t, f in zip(got, first["full prefill"]))
            lines.append(f"| {m} | {', '.join(f'{t:.3f}' for t in got)} | {ratio:.2f} |")
    lines += ["", "The connector's fusion lines (the last prompt's requests, then the fresh engines' first):", "",
              "```"]
    lines += [f[f.index("request "):] for f in fusions[-(len(methods) + 2 + args.fresh):]] + ["```", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
