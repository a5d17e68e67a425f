"""kvtc's rate control: asked against achieved bits per element, beside the level presets, in one run.

    python bench/studies/kvtc_rate.py [--bits 0.3 0.5 0.75 1.0 1.5] [--tokens 1536] [--continuation 512] [--encode-only]

On SmolLM2's three evaluation texts (never calibration text), as bench/rate_distortion.py measures them: every
``kvtc:bits=B`` and every ``kvtc:level=L`` encodes each text's 1536-token float16 cache in 256-token chunks, and
the model continues from the decode.  Per rate: the file's bits per element (every container byte counted) over
the three texts and on the worst text, each chunk's (its frame and index entry) error range, perplexity change
and agreement, and the encode time beside the level of nearest rate.  Writes bench/studies/results/kvtc_rate.md.

``--encode-only`` measures instead what an encode costs in CPU time (one thread, ``time.process_time``: on a
shared machine wall times say more about the neighbours than about the codec) and each rate, without the model's
scoring; it writes bench/studies/results/kvtc_rate-encode.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import kvcodec
from kvcodec.codecs.kvtc import KVTC
from kvcodec.codecs.kvtc.levels import LEVELS
from kvcodec.formats.v1 import INDEX_ENTRY
from kvcodec.tools.evaluate import evaluate, prepare
from kvcodec.codecs.kvtc.fit import ensure_calibration
from kvcodec.models import SMOLLM2, load_model
from kvcodec.texts import DEFAULT_EVAL_TEXTS, load_text

RESULT = Path(__file__).resolve().parent / "results" / "kvtc_rate.md"
ENCODE_RESULT = RESULT.with_name("kvtc_rate-encode.md")
CHUNK_TOKENS = 256


def rates(kv: kvcodec.KVCache, codec: KVTC) -> tuple[float, list[float], float]:
    """The file's bits per element, each chunk's (its frame, head included, and index entry over the chunk's
    elements) and the CPU seconds of the encode (one thread)."""
    t0 = time.process_time()
    blob = kvcodec.encode(kv, codec, chunk_tokens=CHUNK_TOKENS, threads=1)
    cpu = time.process_time() - t0
    with kvcodec.open(blob) as reader:
        per_token = sum(s.heads * (s.key_dim + s.value_dim) for s in reader.info.layers)
        chunks = [8 * (c.length + INDEX_ENTRY.size) / (c.token_count * per_token) for c in reader.chunks]
        return reader.info.bits_per_element, chunks, cpu


def encode_only(args: argparse.Namespace) -> None:
    """Rates and encode CPU time of every level and rate on the three caches, without scoring."""
    t0 = time.time()
    model = load_model(SMOLLM2)
    cal = ensure_calibration(model, log=lambda line: print(line, file=sys.stderr))
    caches = [model.prefill(model.tokenize(load_text(text))[:args.tokens], dtype=torch.float16)
              for text in DEFAULT_EVAL_TEXTS]
    rows = []
    for label, codec in [(f"kvtc:level={level}", KVTC(level=level, calibration=cal)) for level in sorted(LEVELS)] + \
                        [(f"kvtc:bits={b:g}", KVTC(bits=b, calibration=cal)) for b in args.bits]:
        files, chunks, cpu = zip(*(rates(kv, codec) for kv in caches))
        rows.append((label, sum(files) / len(files), [c for per in chunks for c in per], sum(cpu) / len(cpu)))
        print(label, rows[-1][1], rows[-1][3], flush=True)
    levels = [r for r in rows if "level" in r[0]]
    lines = ["# kvtc rate control: encode CPU time (SmolLM2)", "",
             f"Texts: {', '.join(DEFAULT_EVAL_TEXTS)}; {args.tokens}-token float16 prefix in {CHUNK_TOKENS}-token "
             "chunks, one encode per text on one thread; CPU seconds of the process per cache (`time.process_time`), "
             "and the ratio to the level preset of nearest rate. *bits*: the files' mean; *chunks*: each chunk's "
             "rate (frame and index entry).", "",
             "| codec | bits | chunks | encode CPU s/cache | vs level |", "|---|---|---|---|---|"]
    for label, bits, flat, cpu in rows:
        near = min(levels, key=lambda r: abs(r[1] - bits))
        lines.append(f"| `{label}` | {bits:.4f} | {min(flat):.4f}..{max(flat):.4f} | {cpu:.2f} | "
                     + ("" if "level" in label else f"{cpu / near[3]:.2f}x level {near[0].split('=')[1]}") + " |")
    lines += ["", f"kvtc calibration {cal.digest[:16]}.... Made by `python bench/studies/kvtc_rate.py --encode-only` in "
              f"{time.time() - t0:.0f} s (load average {os.getloadavg()[0]:.1f} at the end, 2 shared cores)."]
    ENCODE_RESULT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=float, nargs="+", default=[0.3, 0.5, 0.75, 1.0, 1.5])
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    p.add_argument("--encode-only", action="store_true", help="encode CPU time and rates only (no scoring)")
    args = p.parse_args()
    if args.encode_only:
        encode_only(args)
        return
    t0 = time.time()
    model = load_model(SMOLLM2)
    cal = ensure_calibration(model, log=lambda line: print(line, file=sys.stderr))
    cases = [prepare(model, text, args.tokens, args.continuation) for text in DEFAULT_EVAL_TEXTS]
    levels = [KVTC(level=level, calibration=cal) for level in sorted(LEVELS)]
    asked = [KVTC(bits=b, calibration=cal) for b in args.bits]
    rows = evaluate(model, cases, levels + asked, chunk_tokens=CHUNK_TOKENS,
                    labels=[f"kvtc:level={level}" for level in sorted(LEVELS)] + [f"kvtc:bits={b:g}" for b in args.bits])
    level_rows = rows[:len(levels)]
    lines = [f"# kvtc rate control (`kvtc:bits=B`) on SmolLM2 ({model.model_id})", "",
             f"Texts: {', '.join(DEFAULT_EVAL_TEXTS)} (evaluation texts: never calibration text); {args.tokens}-token "
             f"float16 prefix in {CHUNK_TOKENS}-token chunks, perplexity of the next {args.continuation} tokens, as "
             "bench/rate_distortion.py. *achieved*: the files' bits per element over the three texts, every container "
             "byte counted; *worst text*: the text whose file is furthest from the rate asked; *chunks*: the range "
             "of each chunk's own rate (its frame and index entry over its elements; the rate is controlled per "
             "chunk), error against the rate asked. Encode: seconds per cache (evaluate's threads), and its ratio to "
             "the level preset of nearest rate.", "",
             "| codec | asked | achieved | error | worst text | chunks | perplexity change | agreement | encode s/cache "
             "| encode vs level |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in level_rows:
        lines.append(f"| `{r.codec}` | | {r.bits_per_element:.4f} | | | | {100 * r.ppl_change:+.3f}% | "
                     f"{100 * r.agreement:.2f}% | {r.encode_s_per_cache:.2f} | |")
    for b, codec, r in zip(args.bits, asked, rows[len(levels):]):
        files, chunks, _ = zip(*(rates(case.kv, codec) for case in cases))
        worst = max(files, key=lambda x: abs(x - b))
        flat = [c for per in chunks for c in per]
        near = min(level_rows, key=lambda lr: abs(lr.bits_per_element - r.bits_per_element))
        lines.append(f"| `{r.codec}` | {b:g} | {r.bits_per_element:.4f} | {100 * (r.bits_per_element / b - 1):+.2f}% | "
                     f"{100 * (worst / b - 1):+.2f}% | {100 * (min(flat) / b - 1):+.2f}%..{100 * (max(flat) / b - 1):+.2f}% | "
                     f"{100 * r.ppl_change:+.3f}% | {100 * r.agreement:.2f}% | {r.encode_s_per_cache:.2f} | "
                     f"{r.encode_s / near.encode_s:.2f}x level {near.codec.split('=')[1]} |")
    lines += ["", f"kvtc calibration {cal.digest[:16]}... ({len(cal.groups)} layer groups, "
              f"{sum(b.components for b in cal.keys)} key and {sum(b.components for b in cal.values)} value components, "
              f"from {', '.join(cal.settings.get('texts', []))}).", "",
              f"Made by `python bench/studies/kvtc_rate.py` in {time.time() - t0:.0f} s on a 2-core CPU shared with other work "
              f"(load average {os.getloadavg()[0]:.1f} at the end): its encode times are wall times under that load; "
              "encode CPU time per codec: [kvtc_rate-encode.md](kvtc_rate-encode.md) (`--encode-only`)."]
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
