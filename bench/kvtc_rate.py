"""kvtc's rate control: asked against achieved bits per element, beside the level presets, in one run.

    python bench/kvtc_rate.py [--bits 0.3 0.5 0.75 1.0 1.5] [--tokens 1536] [--continuation 512]

On SmolLM2's three evaluation texts (never calibration text), as bench/rate_distortion.py measures them: every
``kvtc:bits=B`` and every ``kvtc:level=L`` encodes each text's 1536-token float16 cache in 256-token chunks, and
the model continues from the decode.  Per rate: the file's bits per element (every container byte counted) over
the three texts and on the worst text, each chunk's (its frame and index entry) error range, perplexity change
and agreement, and the encode time beside the level of nearest rate.  Writes bench/results/kvtc_rate.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import kvcodec
from kvcodec.codecs.kvtc import KVTC
from kvcodec.codecs.kvtc.levels import LEVELS
from kvcodec.formats.v1 import INDEX_ENTRY
from kvcodec.tools.evaluate import evaluate, prepare
from kvcodec.tools.kvtc_calibration import ensure_calibration
from kvcodec.tools.models import SMOLLM2, load_model
from kvcodec.tools.texts import DEFAULT_EVAL_TEXTS

RESULT = Path(__file__).resolve().parent / "results" / "kvtc_rate.md"
CHUNK_TOKENS = 256


def rates(kv: kvcodec.KVCache, codec: KVTC) -> tuple[float, list[float]]:
    """The file's bits per element and each chunk's (its frame, head included, and index entry over the chunk's
    elements)."""
    with kvcodec.open(kvcodec.encode(kv, codec, chunk_tokens=CHUNK_TOKENS)) as reader:
        per_token = sum(s.heads * (s.key_dim + s.value_dim) for s in reader.info.layers)
        chunks = [8 * (c.length + INDEX_ENTRY.size) / (c.token_count * per_token) for c in reader.chunks]
        return reader.info.bits_per_element, chunks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=float, nargs="+", default=[0.3, 0.5, 0.75, 1.0, 1.5])
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    args = p.parse_args()
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
        files, chunks = zip(*(rates(case.kv, codec) for case in cases))
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
              f"Made by `python bench/kvtc_rate.py` in {time.time() - t0:.0f} s on a 2-core CPU shared with other work "
              f"(load average {os.getloadavg()[0]:.1f} at the end)."]
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
