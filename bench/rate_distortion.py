"""Rate-distortion of every codec preset on the same real SmolLM2 caches, in one run.

    python bench/rate_distortion.py [--tokens 1536] [--continuation 512]

Writes bench/results/rate_distortion.{md,json,png}: bits per element (every
container byte counted), perplexity change when the model continues from the
decoded cache, and greedy next-token agreement, averaged over three texts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvcodec.cli import parse_codec
from kvcodec.codecs import codec_class, list_codecs
from kvcodec.evaluate import EvalRow, evaluate, prepare, preset_label
from kvcodec.models import load_model
from kvcodec.plot import rate_distortion_plot
from kvcodec.texts import DEFAULT_EVAL_TEXTS

RESULTS = Path(__file__).resolve().parent / "results"
# What cachegen's design choices do, at the default level: CacheGen's anchor/delta coding (groups of 2 and of
# the paper's 10 tokens), no model profile (steps from the keys alone), and no attention-sink token; and
# kvfetcher's 4-bit codes with kivi's min-max scales instead of its default spread steps.
ABLATIONS = ["cachegen:level=2,group=2", "cachegen:level=2,group=10", "cachegen:level=2,profile=none",
             "cachegen:level=2,sink_tokens=0", "kvfetcher:scale=minmax"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--continuation", type=int, default=512)
    p.add_argument("--codec", action="append", help="only these codec ids (default: all registered)")
    p.add_argument("--update", action="store_true",
                   help="re-measure only the --codec ids (their presets and ablations) and keep every other row of "
                        "the existing results, measured on the same texts and lengths")
    args = p.parse_args()
    kept: list[EvalRow] = []
    if args.update:
        if not args.codec:
            p.error("--update needs --codec")
        old = json.loads((RESULTS / "rate_distortion.json").read_text())
        if (old["prefix_tokens"], old["continuation_tokens"], old["texts"]) != (args.tokens, args.continuation,
                                                                                list(DEFAULT_EVAL_TEXTS)):
            p.error("the existing results were measured on other texts or lengths; run without --update")
        kept = [EvalRow.from_dict(r) for r in old["rows"] if r["codec"].split(":")[0] not in args.codec]
    model = load_model("smollm2")
    if not args.codec or "kvtc" in args.codec:  # kvtc's levels need the model's calibration (made once, cached)
        from kvcodec.codecs.kvtc import ensure_calibration

        ensure_calibration(model, log=lambda line: print(line, file=sys.stderr))
    t0 = time.time()
    cases = [prepare(model, text, args.tokens, args.continuation) for text in DEFAULT_EVAL_TEXTS]
    presets = [(cid, preset) for cid in (args.codec or list_codecs()) for preset in codec_class(cid).presets()]
    codecs = [codec_class(cid).from_config(preset) for cid, preset in presets]
    labels = [preset_label(cid, preset) for cid, preset in presets]
    ablations = [spec for spec in ABLATIONS if not args.codec or spec.split(":")[0] in args.codec]
    codecs += [parse_codec(spec) for spec in ablations]
    labels += ablations
    rows = sorted(kept + evaluate(model, cases, codecs, labels=labels),
                  key=lambda r: (r.codec.split(":")[0], r.bits_per_element))
    lines = [f"# Rate-distortion on real KV ({model.model_id})", "",
             f"Texts: {', '.join(DEFAULT_EVAL_TEXTS)}; {args.tokens}-token prefix cached in float16, perplexity of the "
             f"next {args.continuation} tokens, mean over texts. Reference perplexities (from the float16 cache): "
             + ", ".join(f"{c.name} {c.ref_ppl:.3f}" for c in cases) + ".", "",
             "Encode and decode: seconds per cache (one whole-cache call on one thread, mean over the texts) and MB/s "
             "of float16, as `kvcodec eval` and `kvcodec bench` report them.", "",
             "| codec | bits/element | x vs fp16 | perplexity change | agreement | encode s/cache | decode s/cache | "
             "encode MB/s | decode MB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r.codec}` | {r.bits_per_element:.3f} | {16 / r.bits_per_element:.2f} | "
                     f"{100 * r.ppl_change:+.3f}% | {100 * r.agreement:.2f}% | {r.encode_s_per_cache:.2f} | "
                     f"{r.decode_s_per_cache:.2f} | {r.encode_MBps:.1f} | {r.decode_MBps:.1f} |")
    made = f"Made by `python bench/rate_distortion.py` in {time.time() - t0:.0f} s on a 2-core CPU."
    if args.update:
        made = (f"Rows of {', '.join(args.codec)} re-measured by `python bench/rate_distortion.py --update "
                f"{' '.join('--codec ' + c for c in args.codec)}` in {time.time() - t0:.0f} s; the others are from the "
                "previous full run.")
    lines += ["", made]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rate_distortion.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "rate_distortion.json").write_text(json.dumps(
        {"texts": list(DEFAULT_EVAL_TEXTS), "prefix_tokens": args.tokens, "continuation_tokens": args.continuation,
         "reference_ppl": {c.name: c.ref_ppl for c in cases}, "rows": [r.to_dict() for r in rows]}, indent=2) + "\n")
    rate_distortion_plot(rows, str(RESULTS / "rate_distortion.png"), title=f"{model.model_id}: {', '.join(DEFAULT_EVAL_TEXTS)}",
                         separate=ABLATIONS)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
