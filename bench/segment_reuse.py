"""Reusing documents' KV wherever they sit in a prompt (issue 34): quality and time to first token of segment fusion
against a full prefill and against prefix-only reuse (SmolLM2, CPU).

Each prompt is the model's BOS, a system text, ``--docs`` real documents (licenses, pydoc pages, Python sources;
``--doc-tokens`` each) in a shuffled order, and a question.  The documents and the system text are stored once as
segments (raw, in a memory tier); each prompt is then answered by

- a full prefill (the reference);
- fusion (:meth:`TransformersKVHook.fuse`) at recompute shares 0, 5, 15, 30, 50 and 100% (``--shares``): the
  segments loaded from the memory tier (decode included), moved to their positions, the share recomputed, then the
  question;
- prefix-only reuse (:meth:`TransformersKVHook.generate` over a store holding the prompts of the other orders: only
  the stored prefix chunks it shares with them, 256 tokens at a time, load; the rest is computed);
- the full prefill's own KV through cachegen level 2 (encode, decode, continue): the lossy codec the issue's target
  compares against.

Quality against the full prefill: the KL divergence of the next-token distributions over the reference's 64-token
greedy continuation (teacher-forced: every method reads the same tokens), greedy agreement over it, and the
perplexity of a held-out continuation (the first ``--heldout`` tokens of a text in no prompt).  Time to first token is
taken side by side in one run (the ratios are what to read on a shared machine) and is the median over prompts.

With ``--ttft-only REPS``, time to first token alone on the first prompt (full prefill, fusion at ``--shares``,
prefix-only reuse), interleaved REPS times, the fastest of each and the median of each round's ratio to its full prefill:
``bench/results/segment_reuse-ttft.md``.  ``--link MBIT`` keeps the segments in Redis behind a link shaped to that
rate (root: a network namespace and tc, :mod:`kvcodec.tools.netlab`) instead of a memory tier, and ``--codec``
stores them in a codec or a list of variants that each load chooses from (``cachegen,raw``: adaptive).

    python bench/segment_reuse.py [--docs 6] [--doc-tokens 600] [--prompts 3] [--shares 0,0.15,0.3]
    python bench/segment_reuse.py --docs 4 --doc-tokens 500 --prompts 3 --ttft-only 5
    python bench/segment_reuse.py --docs 8 --doc-tokens 490 --prompts 2 --ttft-only 3 --link 1000 --codec cachegen,raw
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

import kvcodec
from kvcodec.engines.transformers_hook import TransformersKVHook
from kvcodec.models import load_model
from kvcodec.store import KVStore, MemoryTier, RedisTier
from kvcodec.texts import load_text
from kvcodec.tools.netlab import ShapedLink, unavailable
from kvcodec.tools.redis_server import started_redis

OUT = Path(__file__).parent / "results" / "segment_reuse.md"
DOCS = ("license:MPL-2.0", "stdlib:textwrap.py", "pydoc:json", "license:Apache-2.0", "stdlib:csv.py",
        "pydoc:itertools", "license:BSD", "stdlib:shlex.py")
SYSTEM = ("You are a careful assistant. Answer the question using only the documents below, and say which "
          "document you used.\n\n")
QUESTIONS = ("\n\nQuestion: Which of these documents is a software license, and what does it permit? Answer:",
             "\n\nQuestion: What does the Python code above do, in one sentence? Answer:",
             "\n\nQuestion: Summarise the documents above in three bullet points. Answer:")
HELDOUT = "license:GPL-3"
SHARES = (0.0, 0.05, 0.15, 0.3, 0.5, 1.0)
CONTINUATION = 64


# Every cache here is a DynamicCache without the model's config: each layer holds the whole sequence, a
# sliding-window one (Gemma 3) too, whose window the model's masks apply; a windowed layer of the config's kind
# keeps only its window, and could not be cropped back after the continuation is read.


@torch.no_grad()
def read(model, cache, ids):
    """Logits ``[len(ids), V]`` of ``model`` reading ``ids`` after ``cache`` (which grows)."""
    return model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0].float()


@torch.no_grad()
def scores(model, first, cache, greedy, heldout):
    """(logits over the greedy continuation, perplexity of the held-out text) after a prompt whose last logits are
    ``first`` and whose cache is ``cache``: the continuation is read, cropped off again, then the held-out text."""
    logits = torch.cat([first[None], read(model, cache, greedy[:-1])])
    cache.crop(-(len(greedy) - 1))
    lp = torch.log_softmax(torch.cat([logits[-1:], read(model, cache, heldout[:-1])]), -1)
    nll = -lp.gather(1, torch.tensor(heldout)[:, None]).mean()
    return logits, float(nll.exp())


def kl(ref, got):
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=6, help="documents per prompt, 2-8 (default 6)")
    ap.add_argument("--doc-tokens", type=int, default=600, help="tokens of each document (default 600)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts (shuffled orders, one question each; default 3)")
    ap.add_argument("--shares", default=",".join(f"{x:g}" for x in SHARES),
                    help="fusion's recompute shares, comma-separated; auto: the loading controller's (default: "
                         "%(default)s)")
    ap.add_argument("--heldout", type=int, default=128, help="held-out continuation tokens (default 128)")
    ap.add_argument("--ttft-only", type=int, metavar="REPS", default=0,
                    help="only time to first token on the first prompt: full prefill, fusion at --shares, "
                         "prefix-only reuse, interleaved REPS times, fastest of each (a busy machine slows some "
                         "runs, never speeds one up); writes bench/results/segment_reuse-ttft.md")
    ap.add_argument("--link", type=float, metavar="MBIT", default=None,
                    help="keep the segments in Redis behind a link shaped to MBIT Mbit/s (root) instead of in memory")
    ap.add_argument("--codec", default="raw",
                    help="the segments' codec, or variants separated by commas that each load picks from (default raw)")
    ap.add_argument("--model", default="smollm2", help="the model (kvcodec.models.load_model's names: smollm2, "
                                                       "gemma3-270m; default smollm2)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not 2 <= args.docs <= len(DOCS):
        ap.error(f"--docs is 2 to {len(DOCS)}")
    try:
        args.shares = [None if x == "auto" else float(x) for x in args.shares.split(",")]
    except ValueError:
        ap.error(f"--shares is fractions (or auto) separated by commas, not {args.shares!r}")
    if not all(x is None or 0 <= x <= 1 for x in args.shares):
        ap.error("--shares are fractions in 0..1, or auto (the loading controller's)")
    if args.link is not None and (why := unavailable()):
        ap.error(f"--link: {why}")
    with contextlib.ExitStack() as stack:
        run(args, stack)


def segment_tier(args, stack: contextlib.ExitStack):
    """Where the segments are kept: a memory tier, or Redis behind a link of ``--link`` Mbit/s (unshaped while they
    are stored), with the link (None for memory)."""
    if args.link is None:
        return MemoryTier(None), None
    link = stack.enter_context(ShapedLink(100_000))
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcodec-segment-reuse-")))
    redis = started_redis(folder, link)
    stack.callback(redis.stop)
    # a raw 256-token chunk of SmolLM2 float32 KV is 11.8 MB: about 1 s at 100 Mbit/s, past the tier's 0.2 s default
    return RedisTier(redis.host, redis.port, timeout_s=60), link


def run(args, stack: contextlib.ExitStack) -> None:
    lm = load_model(args.model, progress=False)
    model, tok = lm.model, lm.tokenize
    system = tok(SYSTEM)
    docs = [tok(load_text(spec)[:args.doc_tokens * 8])[:args.doc_tokens] for spec in DOCS[:args.docs]]
    heldout = tok(load_text(HELDOUT))[:args.heldout]
    tier, link = segment_tier(args, stack)
    codec = args.codec.split(",") if "," in args.codec else args.codec
    hook = TransformersKVHook(lm, KVStore([tier], model=lm.model_id, codec=codec), save=False)
    t0 = time.perf_counter()
    hook.put_segments([system] + docs)
    put_s = time.perf_counter() - t0
    if link is not None:
        link.set_rate(args.link)
    anchor = list(hook.segments.anchor)
    rng = random.Random(0)
    orders = []
    for _ in range(args.prompts):
        order = list(range(args.docs))
        rng.shuffle(order)
        orders.append(order)
    prompts = [(anchor + system + [t for i in order for t in docs[i]], tok(QUESTIONS[p % len(QUESTIONS)]))
               for p, order in enumerate(orders)]
    if args.ttft_only:
        ttft(args, lm, hook, prompts, [[system] + [docs[i] for i in o] for o in orders])
        return
    methods = [name(s) for s in args.shares] + ["prefix-only reuse", "cachegen level 2 (full prefill's KV)"]
    rows: dict[str, dict[str, list[float]]] = {m: {"kl": [], "agree": [], "ppl": [], "ttft": [], "ratio": [],
                                                   "work": []} for m in methods + ["full prefill"]}
    refs = []
    for context, question in tqdm(prompts, desc="full prefills", unit="prompt"):
        ids = context + question
        cache = DynamicCache()
        last = read(model, cache, ids)[-1]
        kv = kvcodec.KVCache.from_hf(cache, model=lm.model_id, token_ids=ids, rope="post")
        greedy = [int(last.argmax())]
        while len(greedy) < CONTINUATION:
            greedy.append(int(read(model, cache, [greedy[-1]])[-1].argmax()))
        cache.crop(-(len(greedy) - 1))
        ref, ref_ppl = scores(model, last, cache, greedy, heldout)
        rows["full prefill"]["ppl"].append(ref_ppl)
        refs.append((kv, greedy, ref))
    for p, (context, question) in enumerate(tqdm(prompts, desc="methods", unit="prompt")):
        ids = context + question
        kv, greedy, ref = refs[p]
        order = [system] + [docs[i] for i in orders[p]]

        def record(name, logits, ppl, ttft, work):
            r = rows[name]
            r["kl"].append(kl(ref, logits))
            r["agree"].append(float((ref.argmax(-1) == logits.argmax(-1)).double().mean()))
            r["ppl"].append(ppl)
            r["ttft"].append(ttft)
            r["ratio"].append(ttft / full_s)
            r["work"].append(work)

        t = time.perf_counter()  # the full prefill's time to first token, beside the others'
        read(model, DynamicCache(), ids)
        full_s = time.perf_counter() - t
        rows["full prefill"]["ttft"].append(full_s)
        for share in args.shares:
            fused = hook.fuse(order, question, share=share)
            logits, ppl = scores(model, fused.logits[-1].float(), fused.cache, greedy, heldout)
            record(name(share), logits, ppl, fused.report.first_token_s, fused.report.recomputed_share)
        # prefix-only reuse: the store's prefix chunks (256 tokens) of the other prompts, so what this prompt shares
        # with them loads (the system text alone is shorter than a chunk: only a prompt that leads with the same
        # document as another finds anything)
        prefix_hook = TransformersKVHook(lm, KVStore([MemoryTier(None)], model=lm.model_id, codec="raw"), save=False)
        for q, other in enumerate(refs):
            if q != p:
                prefix_hook.store.put(other[0].token_ids, other[0])
        done = prefix_hook.generate(ids, max_new_tokens=1)
        n = done.loaded_tokens
        loaded = prefix_hook.store.get(ids[:n]) if n else None
        c = loaded.to_hf() if loaded is not None else DynamicCache()
        last = read(model, c, ids[n:])[-1]
        logits, ppl = scores(model, last, c, greedy, heldout)
        record("prefix-only reuse", logits, ppl, done.first_token_s, 1 - n / len(context))
        # cachegen level 2 over the full prefill's context KV
        ctx_kv = kvcodec.KVCache([(l.keys[:, :len(context)], l.values[:, :len(context)]) for l in kv.layers],
                                 model=lm.model_id, rope="post")
        c = kvcodec.decode(kvcodec.encode(ctx_kv, codec="cachegen")).to(dtype=model.dtype).to_hf()
        last = read(model, c, question)[-1]
        logits, ppl = scores(model, last, c, greedy, heldout)
        record(methods[-1], logits, ppl, float("nan"), float("nan"))
    report(args, rows, methods, prompts, put_s)


def ttft(args, lm, hook, prompts, orders) -> None:
    """Time to first token of the first prompt, each way ``args.ttft_only`` times, interleaved; the fastest of
    each.  Prefix-only reuse finds the other prompts' prefix chunks, as in the quality run."""
    model = lm.model
    context, question = prompts[0]
    ids = context + question
    prefix_store = KVStore([MemoryTier(None)], model=lm.model_id, codec="raw")
    for c, q in prompts[1:]:
        prefix_store.put(c + q, lm.prefill(c + q))
    prefix_hook = TransformersKVHook(lm, prefix_store, save=False)
    times: dict[str, list[float]] = {"full prefill": [], **{name(s): [] for s in args.shares},
                                     "prefix-only reuse": []}
    loads: dict[str, list[tuple[float, int, float]]] = {name(s): [] for s in args.shares}
    loaded = 0
    for _ in tqdm(range(args.ttft_only), desc="ttft", unit="round"):
        t = time.perf_counter()  # the last position's logits only, as fusion computes the question's only
        with torch.no_grad():
            model(torch.tensor([ids]), cache=DynamicCache(), use_cache=True, logits_to_keep=1)
        times["full prefill"].append(time.perf_counter() - t)
        for share in args.shares:
            r = hook.fuse(orders[0], question, share=share).report
            times[name(share)].append(r.first_token_s)
            loads[name(share)].append((r.load_s, r.nbytes, r.share))
        done = prefix_hook.generate(ids, max_new_tokens=1)
        times["prefix-only reuse"].append(done.first_token_s)
        loaded = done.loaded_tokens
    best = {k: min(v) for k, v in times.items()}
    # each round's own ratio as well: a load that changes between rounds moves both sides of it alike
    paired = {k: statistics.median(t / f for t, f in zip(v, times["full prefill"])) for k, v in times.items()}

    def load(k: str) -> str:
        if k not in loads:
            return "- | - | -"
        seconds, nbytes, share = (statistics.median(x[n] for x in loads[k]) for n in range(3))
        return f"{seconds:.3f} | {nbytes / 1e6:.1f} | {share:.0%}"

    lines = ["| method | fastest TTFT (s) | median (s) | fastest / full prefill's fastest | median of the rounds' "
             "ratios | load, median (s) | MB loaded | share |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {k} | {best[k]:.3f} | {statistics.median(v):.3f} | {best[k] / best['full prefill']:.2f} | "
              f"{paired[k]:.2f} | {load(k)} |" for k, v in times.items()]
    table = "\n".join(lines)
    print(table)
    out = args.out or OUT.with_name("segment_reuse-ttft.md")
    out.write_text(f"""# Segment reuse: time to first token ({lm.model_id}, CPU)

`python bench/segment_reuse.py --docs {args.docs} --doc-tokens {args.doc_tokens} --prompts {args.prompts} --ttft-only {args.ttft_only}{command_tail(args)}`
(issue 34; quality: [segment_reuse.md](segment_reuse.md)).  One prompt of {len(ids)} tokens, each way
{args.ttft_only} times, interleaved; the fastest of each (a shared 2-core machine slows runs, never speeds one up),
and the median over the rounds of each round's time against that round's full prefill.
Fusion includes loading and decoding the segments ({kept(args)}); prefix-only reuse loaded {loaded}
tokens of the other prompts' prefix chunks and computed the rest.

{table}
""")
    print(f"wrote {out}")


def name(share: float | None) -> str:
    """A fusion's row: its share, or the loading controller's."""
    return "fusion, the controller's share" if share is None else f"fusion {share:.0%}"


def command_tail(args) -> str:
    """The options of this run that are not the defaults, as typed."""
    tail = "" if args.shares == list(SHARES) else \
        f" --shares {','.join('auto' if x is None else f'{x:g}' for x in args.shares)}"
    tail += "" if args.link is None else f" --link {args.link:g}"
    tail += "" if args.codec == "raw" else f" --codec {args.codec}"
    tail += "" if args.model == "smollm2" else f" --model {args.model}"
    return tail + ("" if args.out is None else f" --out {args.out}")


def kept(args) -> str:
    """Where and how the segments are kept, in words."""
    where = "a memory tier" if args.link is None else f"Redis behind a link shaped to {args.link:g} Mbit/s"
    how = "raw" if args.codec == "raw" else (f"as variants {args.codec} (each load picks)" if "," in args.codec
                                             else args.codec)
    return f"{how}, in {where}"


def report(args, rows, methods, prompts, put_s) -> None:
    ref_ppl = statistics.mean(rows["full prefill"]["ppl"])
    tokens = [len(c) + len(q) for c, q in prompts]

    def med(xs):
        xs = [x for x in xs if not math.isnan(x)]
        return statistics.median(xs) if xs else float("nan")

    head = ["method", "KL (nats/token)", "greedy agreement", f"held-out ppl (full: {ref_ppl:.3f})",
            "token-layers computed", "TTFT (s)", "TTFT / full prefill"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full_ttft = med(rows["full prefill"]["ttft"])
    lines.append(f"| full prefill | 0 | 1.000 | {ref_ppl:.3f} | 100% | {full_ttft:.2f} | 1.00 |")
    for m in methods:
        r = rows[m]
        ttft = med(r["ttft"])
        lines.append(f"| {m} | {statistics.mean(r['kl']):.4f} | {statistics.mean(r['agree']):.3f} | "
                     f"{statistics.mean(r['ppl']):.3f} | "
                     + ("-" if math.isnan(med(r["work"])) else f"{med(r['work']):.1%}") + " | "
                     + ("-" if math.isnan(ttft) else f"{ttft:.2f}") + " | "
                     + ("-" if math.isnan(ttft) else f"{med(r['ratio']):.2f}") + " |")
    table = "\n".join(lines)
    print(table)
    text = f"""# Segment reuse: fusion with selective recompute against a full prefill ({args.model}, CPU)

`python bench/segment_reuse.py --docs {args.docs} --doc-tokens {args.doc_tokens} --prompts {args.prompts}{command_tail(args)}`
(issue 34; [docs/segments.md](../../docs/segments.md)).  {args.prompts} prompts of {min(tokens)}-{max(tokens)} tokens:
the model's BOS, a system text, {args.docs} real documents of {args.doc_tokens} tokens ({", ".join(DOCS[:args.docs])})
in shuffled orders, and a question.  Segments stored once, {kept(args)} ({put_s:.1f} s for all); KL and
greedy agreement over the full prefill's {CONTINUATION}-token greedy continuation (teacher-forced), perplexity of
{args.heldout} held-out tokens ({HELDOUT}) read after the prompt; means over the prompts.  TTFT: medians over the
prompts, fusion's including the segments' load and decode; the ratio is taken within each
prompt (side by side), then its median.  "token-layers computed": the share of the context's tokens times layers
that ran (a full prefill: 100%); for prefix-only reuse, the share of the context not loaded.  Shared 2-core machine:
read the ratios.

{table}
"""
    out = args.out or OUT
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
