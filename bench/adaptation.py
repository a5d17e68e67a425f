"""Bandwidth adaptation on a real SmolLM2 KV cache, scaled to a Llama-3-8B serving case.

    python bench/adaptation.py [--codec SPEC ...] [--dump PATH] [--budget-s S] [--mean-gbps G]

1. A real float16 SmolLM2-135M KV dump (made with ``kvcodec dump`` if missing) is
   encoded into one multi-level container (levels from ``--codec``, smallest to
   best; default: CacheGen levels if a ``cachegen`` codec is registered, else
   kivi 2/4/8 bits), ``--chunk-tokens`` tokens per chunk.
2. The per-chunk frame sizes of every level are read from the container's
   index and scaled to a Llama-3-8B cache (32 layers x 8 KV heads x 128 dims,
   float16: 131072 bytes per token) by the ratio of its bytes per token to the
   dump's (the dump's bits per element are kept), then tiled cyclically to
   ``--context-tokens`` tokens (default 8192: 32 chunks of 256 tokens).
3. Recomputing a chunk is a parameter, not a measurement: Llama-3-8B prefill
   FLOPs of that chunk with its prefix (2 x 6.98e9 non-embedding parameters per
   token, plus causal attention over the prefix) at ``--gpu-tflops`` effective
   TFLOP/s (default 150: an A100 at about half its 312 TFLOP/s bf16 peak), or a
   constant ``--recompute-s`` per chunk.  (SmolLM2 prefill on this shared CPU
   is neither a serving GPU nor stable enough to time.)
4. Three bandwidth traces around ``--mean-gbps`` (steady, a drop, jittery from
   ``--seed``) are simulated with :func:`kvcodec.tools.adaptation.simulate` for the
   adaptive policy, every fixed level and full recompute, and the table is
   printed and written to ``bench/results/adaptation.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import kvcodec
from kvcodec.store.telemetry import RateEstimator
from kvcodec.tools.adaptation import AdaptationPolicy, BandwidthTrace, ChunkTable, compare
from real_kv import gpl3_dump  # bench/ is on sys.path when this runs as a script

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "adaptation.md"

# Llama-3-8B: 32 layers, 8 KV heads of 128 dims (GQA), hidden 4096, float16 KV
LLAMA3_8B = dict(layers=32, kv_heads=8, head_dim=128, hidden=4096, params_non_embedding=6.98e9, dtype_bytes=2)
LLAMA3_8B_BYTES_PER_TOKEN = LLAMA3_8B["layers"] * LLAMA3_8B["kv_heads"] * 2 * LLAMA3_8B["head_dim"] * 2


def prefill_flops(token_start: int, token_count: int) -> float:
    """Llama-3-8B FLOPs to prefill ``token_count`` tokens after ``token_start`` cached ones."""
    m = LLAMA3_8B
    dense = 2 * m["params_non_embedding"] * token_count
    # QK^T and AV: 2 x 2 FLOPs per (query, key, dim) pair per layer, causal: mean context start + (n+1)/2
    attention = 4 * m["layers"] * m["hidden"] * token_count * (token_start + (token_count + 1) / 2)
    return dense + attention


def default_levels() -> tuple[list[str], str]:
    if "cachegen" in kvcodec.list_codecs():
        specs = [f"cachegen:level={k}" for k in range(5)]
        try:
            for s in specs:
                _codec(s)
            return specs, "cachegen levels 0..4"
        except kvcodec.KVCodecError as e:
            print(f"cachegen is registered but {specs[0]} failed ({e}); using kivi 2/4/8", file=sys.stderr)
    return ["kivi:bits=2", "kivi:bits=4", "kivi:bits=8"], "kivi 2/4/8 bits (no cachegen codec registered)"


def _codec(spec: str) -> kvcodec.Codec:
    from kvcodec.cli import parse_codec
    return parse_codec(spec)


def build_table(kv: kvcodec.KVCache, specs: list[str], chunk_tokens: int) -> tuple[ChunkTable, list[str], float]:
    """Encode ``kv`` at every level into one container; the table from its index, levels sorted smallest first."""
    t0 = time.perf_counter()
    blob = kvcodec.encode(kv, [_codec(s) for s in specs], chunk_tokens=chunk_tokens)
    table = ChunkTable.from_reader(kvcodec.open(blob))
    totals = [table.level_bytes(k) for k in range(table.num_levels)]
    order = sorted(range(len(specs)), key=lambda k: totals[k])
    if order != list(range(len(specs))):
        print(f"levels reordered smallest first: {[specs[k] for k in order]}", file=sys.stderr)
        specs = [specs[k] for k in order]
        table = ChunkTable.from_reader(
            kvcodec.open(kvcodec.encode(kv, [_codec(s) for s in specs], chunk_tokens=chunk_tokens)))
    return dataclasses.replace(table, level_names=tuple(specs)), specs, time.perf_counter() - t0


def traces(mean_bps: float, budget_s: float, seed: int) -> list[BandwidthTrace]:
    horizon = 6 * budget_s
    return [
        BandwidthTrace.steady(mean_bps, "steady"),
        BandwidthTrace([(0.0, 1.5 * mean_bps), (0.25 * budget_s, 0.2 * mean_bps), (0.55 * budget_s, 1.5 * mean_bps)],
                       "drop"),
        BandwidthTrace.jittery(mean_bps, horizon, budget_s / 20, sigma=0.6, seed=seed, name=f"jittery(seed={seed})"),
    ]


def summary(policy: AdaptationPolicy, others: list[AdaptationPolicy], mean_bps: float, prior: float,
            args: argparse.Namespace) -> list[str]:
    """Every strategy over ``args.seeds`` jittery traces (seeds 0..N-1)."""
    runs: dict[str, list] = {}
    for seed in range(args.seeds):
        trace = BandwidthTrace.jittery(mean_bps, 6 * args.budget_s, args.budget_s / 20, sigma=0.6, seed=seed)
        for res in compare(policy, trace, lambda: RateEstimator(prior, args.window), others=others):
            runs.setdefault(res.policy, []).append(res)
    lines = [
        f"## summary over {args.seeds} jittery traces (seeds 0..{args.seeds - 1}, same parameters)",
        "",
        "| strategy | budget met | mean TTFT (s) | worst TTFT (s) | mean bits/element sent | mean chunks recomputed |",
        "|---|---|---|---|---|---|",
    ]
    for name, results in runs.items():
        bits = [r.bits_per_element for r in results if not math.isnan(r.bits_per_element)]
        ttft = [r.ttft_s for r in results]
        lines.append(f"| {name} | {sum(r.met_budget for r in results)}/{len(results)} | {statistics.mean(ttft):.3f} | "
                     f"{max(ttft):.3f} | {f'{statistics.mean(bits):.3f}' if bits else '-'} | "
                     f"{statistics.mean(r.levels.count(-1) for r in results):.1f} |")
    lines.append("")
    return lines


def gbps(bps: float) -> str:
    return f"{bps * 8 / 1e9:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", help="a SmolLM2 KV dump (default: 1536 tokens of real_kv.gpl3_dump, made if missing)")
    ap.add_argument("--codec", action="append", help="a level, ID[:k=v,...]; repeat, smallest to best")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--context-tokens", type=int, default=8192, help="tokens of the simulated context (default 8192)")
    ap.add_argument("--no-scale", action="store_true", help="simulate the dump's own sizes (no Llama-3-8B scaling)")
    ap.add_argument("--budget-s", type=float, default=0.5, help="TTFT budget in seconds (default 0.5)")
    ap.add_argument("--mean-gbps", type=float, default=3.0, help="mean link bandwidth of the traces, Gbit/s")
    ap.add_argument("--gpu-tflops", type=float, default=150.0, help="effective TFLOP/s of recompute (default 150)")
    ap.add_argument("--recompute-s", type=float, help="recompute seconds per chunk (instead of the FLOP model)")
    ap.add_argument("--prior-gbps", type=float, default=1.0, help="bandwidth estimate before the first chunk")
    ap.add_argument("--window", type=int, default=3, help="chunks in the estimator's harmonic mean")
    ap.add_argument("--safety", type=float, default=0.8,
                    help="also run the policy planning with this share of its estimate (default 0.8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=100, help="jittery traces in the summary over seeds (default 100)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="markdown table (default bench/results/adaptation.md)")
    args = ap.parse_args(argv)

    args.dump = args.dump or str(gpl3_dump(1536))
    kv = kvcodec.KVCache.load_safetensors(args.dump)
    specs, level_source = (args.codec, "--codec") if args.codec else default_levels()
    real, specs, encode_s = build_table(kv, specs, args.chunk_tokens)
    dump_bytes_per_token = sum(s.heads * (s.key_dim + s.value_dim) for s in kv.shapes) * kv.dtype.itemsize
    if args.no_scale:
        factor, table, scale_note = 1.0, real, "none: the dump's own chunk sizes"
    else:
        factor = LLAMA3_8B_BYTES_PER_TOKEN / dump_bytes_per_token
        n = math.ceil(args.context_tokens / args.chunk_tokens)
        table = real.scaled(factor).tiled(n)
        scale_note = (f"x{factor:.3f} (Llama-3-8B {LLAMA3_8B_BYTES_PER_TOKEN} B/token over the dump's "
                      f"{dump_bytes_per_token} B/token), tiled to {n} chunks = {sum(table.token_counts)} tokens")
    if args.recompute_s is not None:
        recompute = args.recompute_s
        recompute_note = f"{args.recompute_s} s per chunk (--recompute-s)"
    else:
        tflops = args.gpu_tflops

        def recompute(t0: int, n: int) -> float:
            return prefill_flops(t0, n) / (tflops * 1e12)
        recompute_note = (f"Llama-3-8B prefill FLOPs at {tflops:g} effective TFLOP/s (a parameter, not measured): "
                          f"{recompute(0, args.chunk_tokens) * 1e3:.1f} ms for the first chunk, "
                          f"{recompute(table.token_starts[-1], table.token_counts[-1]) * 1e3:.1f} ms for the last")

    policy = AdaptationPolicy(table, args.budget_s, recompute)
    others = [AdaptationPolicy(table, args.budget_s, recompute, safety=args.safety)] if args.safety != 1 else []
    mean_bps = args.mean_gbps * 1e9 / 8
    prior = args.prior_gbps * 1e9 / 8

    lines = [
        "# Bandwidth adaptation (`python bench/adaptation.py`)",
        "",
        f"- KV: `{args.dump}`: {kv} ({kv.dtype}), {real.num_chunks} chunks of {args.chunk_tokens} tokens; "
        f"levels: {level_source}, encoded in {encode_s:.1f} s",
        f"- sizes: {scale_note}",
        f"- recompute: {recompute_note}; sum over all chunks "
        f"{sum(policy.recompute_cost(i) for i in range(table.num_chunks)):.3f} s",
        f"- budget: TTFT <= {args.budget_s} s (TTFT = all KV ready; the query's own prefill left out)",
        f"- estimator: harmonic mean of the last {args.window} chunk throughputs, prior {args.prior_gbps} Gbit/s",
        "- model of time: one link, chunks in order; one compute device, parallel to the link, decodes for free "
        "and recomputes a chunk once every earlier chunk is ready",
        "",
        "| level | bits/element | MB per chunk (scaled) | whole context MB | transfer at mean bandwidth (s) |",
        "|---|---|---|---|---|",
    ]
    elements = sum(table.elements or ())
    for k, name in enumerate(table.level_names):
        total = table.level_bytes(k)
        lines.append(f"| {k}: {name} | {8 * total / elements:.3f} | {total / table.num_chunks / 1e6:.2f} | "
                     f"{total / 1e6:.1f} | {total / mean_bps:.3f} |")
    lines.append("")
    for trace in traces(mean_bps, args.budget_s, args.seed):
        within = trace.mean_rate(0.0, args.budget_s)
        lines += [
            f"## trace `{trace.name}`: mean {gbps(within)} Gbit/s over the budget "
            f"(segments: {len(trace.segments)}, from {gbps(min(r for _, r in trace.segments))} "
            f"to {gbps(max(r for _, r in trace.segments))} Gbit/s)",
            "",
            "| strategy | TTFT (s) | TTFT / budget | budget met | levels (chunks) | per chunk (R = recompute) "
            "| bits/element sent | MB sent |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for res in compare(policy, trace, lambda: RateEstimator(prior, args.window), others=others):
            hist = ", ".join(f"{name}: {c}" for name, c in res.histogram.items())
            bpe = "-" if math.isnan(res.bits_per_element) else f"{res.bits_per_element:.3f}"
            lines.append(f"| {res.policy} | {res.ttft_s:.3f} | {res.ttft_s / args.budget_s:.2f} | "
                         f"{'yes' if res.met_budget else 'NO'} | {hist} | `{res.level_string()}` | {bpe} | "
                         f"{res.bytes_sent / 1e6:.1f} |")
        lines.append("")
    lines += summary(policy, others, mean_bps, prior, args)
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
