"""Rate-distortion of every codec preset on the same real SmolLM2 caches, in one run.

    python bench/rate_distortion.py [--tokens 1536] [--continuation 512] [--model gemma3-270m --codec ...]
    python bench/rate_distortion.py --texts heldout --per-text --name kvtc_heldout --codec kvtc --codec cachegen ...

Writes bench/results/rate_distortion.{md,json,png}: bits per element (every
container byte counted), perplexity change when the model continues from the
decoded cache, and greedy next-token agreement, averaged over three texts.
Another model (``--model``, any spec ``kvcodec dump`` takes) writes
bench/results/rate_distortion-<model>.{md,json,png}, without the cachegen
design ablations (they were SmolLM2's measurements).  ``--texts`` measures on
other texts (``heldout``: kvcodec.texts.HELDOUT_TEXTS, kinds of text no
calibration default is of), without the ablations, into ``--name``'s files;
``--per-text`` adds each text's own numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvcodec.api import decode, encode
from kvcodec.cli import parse_codec
from kvcodec.codecs import codec_class, list_codecs
from kvcodec.tools.evaluate import EvalRow, evaluate, prepare, preset_label
from kvcodec.models import SMOLLM2, LoadedModel, load_model
from kvcodec.tools.plot import rate_distortion_plot
from kvcodec.texts import DEFAULT_EVAL_TEXTS, HELDOUT_TEXTS, load_text

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
    p.add_argument("--model", default=SMOLLM2, help=f"the model (default: {SMOLLM2}; others write their own files)")
    p.add_argument("--codec", action="append", help="only these codec ids (default: all registered)")
    p.add_argument("--texts", default=",".join(DEFAULT_EVAL_TEXTS),
                   help="comma-separated text specs, or 'heldout' for kvcodec.texts.HELDOUT_TEXTS (default: "
                        "the evaluation texts)")
    p.add_argument("--name", help="results file name in bench/results without suffix (default: rate_distortion, "
                                  "or rate_distortion-<model> for another model); needed with other --texts")
    p.add_argument("--per-text", action="store_true", help="also measure and list each text's own numbers")
    p.add_argument("--spec", action="append", default=[],
                   help="also measure this codec spec (kvtc:level=2,calibration=FILE: another calibration)")
    p.add_argument("--update", action="store_true",
                   help="re-measure only the --codec ids (their presets and ablations) and keep every other row of "
                        "the existing results, measured on the same texts and lengths")
    p.add_argument("--times-only", action="store_true",
                   help="re-measure only the encode and decode times of every existing row (on the same caches; "
                        "each row's bytes must come out the same, so its quality columns still hold)")
    args = p.parse_args()
    args.texts = list(HELDOUT_TEXTS) if args.texts == "heldout" else [t for t in args.texts.split(",") if t]
    if not args.texts:
        p.error("--texts names no text")
    if args.texts != list(DEFAULT_EVAL_TEXTS) and not args.name:
        p.error("--texts other than the evaluation texts needs --name (the default files hold those texts' rows)")
    kept: list[EvalRow] = []
    old = None
    if args.update or args.times_only:
        if args.update and not args.codec:
            p.error("--update needs --codec")
        old = json.loads(results_path(args, ".json").read_text())
        if (old["prefix_tokens"], old["continuation_tokens"], old["texts"]) != (args.tokens, args.continuation,
                                                                                args.texts):
            p.error("the existing results were measured on other texts or lengths; run without --update/--times-only")
        kept = [EvalRow.from_dict(r) for r in old["rows"] if r["codec"].split(":")[0] not in (args.codec or [])]
    model = load_model(args.model)
    calibration = None
    if not args.codec or "kvtc" in args.codec:  # kvtc's levels need the model's calibration (made once, cached)
        from kvcodec.codecs.kvtc.fit import ensure_calibration

        calibration = ensure_calibration(model, log=lambda line: print(line, file=sys.stderr))
    t0 = time.time()
    if args.times_only:
        rows = retime(model, kept, args.tokens, args.texts)
        reference_ppl = old["reference_ppl"]
        write(args, model, rows, reference_ppl, calibration, f"Encode and decode times re-measured by `python bench/rate_distortion.py "
              f"--times-only` in {time.time() - t0:.0f} s (every row's bytes came out the same); bits, perplexity and "
              "agreement are from the previous full run.")
        return
    cases = [prepare(model, text, args.tokens, args.continuation) for text in args.texts]
    presets = [(cid, preset) for cid in (args.codec or list_codecs()) for preset in codec_class(cid).presets()]
    codecs = [codec_class(cid).from_config(preset) for cid, preset in presets]
    labels = [preset_label(cid, preset) for cid, preset in presets]
    ablations = [spec for spec in ABLATIONS if args.model == SMOLLM2 and args.texts == list(DEFAULT_EVAL_TEXTS)
                 and (not args.codec or spec.split(":")[0] in args.codec)]
    codecs += [parse_codec(spec) for spec in ablations + args.spec]
    labels += ablations + args.spec
    per_text: dict[str, list[EvalRow]] = {}
    if args.per_text:  # each text alone; the mean rows are these texts' rows combined
        per_text = {c.name: evaluate(model, [c], codecs, labels=labels) for c in cases}
        new = [combine(parts) for parts in zip(*per_text.values())]
    else:
        new = evaluate(model, cases, codecs, labels=labels)
    rows = sorted(kept + new, key=lambda r: (r.codec.split(":")[0], r.bits_per_element))
    made = f"Made by `python bench/{' '.join([Path(__file__).name] + sys.argv[1:])}` in {time.time() - t0:.0f} s on a 2-core CPU."
    if args.update:
        made = (f"Rows of {', '.join(args.codec)} re-measured by `python bench/rate_distortion.py --update "
                f"{' '.join('--codec ' + c for c in args.codec)}` in {time.time() - t0:.0f} s; the others are from the "
                "previous full run.")
    write(args, model, rows, {c.name: c.ref_ppl for c in cases}, calibration, made, per_text)


def combine(parts: list[EvalRow]) -> EvalRow:
    """One row over several texts' rows of a codec, as :func:`evaluate` makes it over all of them at once."""
    elements = sum(r.bytes * 8 / r.bits_per_element for r in parts)
    n = sum(r.cases for r in parts)
    return EvalRow(parts[0].codec, sum(r.bytes for r in parts), 8 * sum(r.bytes for r in parts) / elements,
                   sum(r.ppl_change * r.cases for r in parts) / n, sum(r.agreement * r.cases for r in parts) / n,
                   sum(r.encode_s for r in parts), sum(r.decode_s for r in parts), n, sum(r.raw_bytes for r in parts),
                   sum(r.kl * r.cases for r in parts) / n)


def retime(model: LoadedModel, rows: list[EvalRow], tokens: int, texts: list[str]) -> list[EvalRow]:
    """``rows`` with encode and decode seconds measured again (one whole-cache call on one thread per cache, as
    :func:`evaluate` times them) on the same prefixes; a row whose bytes differ now is an error."""
    caches = [model.prefill(model.tokenize(load_text(text))[:tokens], dtype=torch.float16) for text in texts]
    out = []
    for row in rows:
        codec = parse_codec(row.codec)
        size = enc = dec = raw = 0
        for kv in caches:
            t0 = time.perf_counter()
            blob = encode(kv, codec, threads=1)
            t1 = time.perf_counter()
            decode(blob, threads=1)
            enc, dec = enc + t1 - t0, dec + time.perf_counter() - t1
            size, raw = size + len(blob), raw + kv.nbytes
        if size != row.bytes:
            raise SystemExit(f"{row.codec} now makes {size} bytes, not {row.bytes}: run without --times-only")
        out.append(dataclasses.replace(row, encode_s=enc, decode_s=dec, cases=len(caches), raw_bytes=raw))
        print(f"{row.codec}: encode {enc / len(caches):.2f} s, decode {dec / len(caches):.2f} s per cache", flush=True)
    return out


def results_path(args: argparse.Namespace, suffix: str) -> Path:
    """bench/results/<--name><suffix>; by default rate_distortion<suffix> for SmolLM2, rate_distortion-<model><suffix>
    for another model."""
    name = args.name or ("rate_distortion" if args.model == SMOLLM2 else
                         "rate_distortion-" + Path(args.model).name.removesuffix(".gguf"))
    return RESULTS / (name + suffix)


def write(args: argparse.Namespace, model: LoadedModel, rows: list[EvalRow], reference_ppl: dict[str, float],
          calibration: Any, made: str, per_text: dict[str, list[EvalRow]] | None = None) -> None:
    lines = [f"# Rate-distortion on real KV ({model.model_id})", "",
             f"Texts: {', '.join(args.texts)}; {args.tokens}-token prefix cached in float16, perplexity of the "
             f"next {args.continuation} tokens, mean over texts. Reference perplexities (from the float16 cache): "
             + ", ".join(f"{name} {ppl:.3f}" for name, ppl in reference_ppl.items()) + ".", "",
             "Encode and decode: seconds per cache (one whole-cache call on one thread, mean over the texts) and MB/s "
             "of float16, as `kvcodec eval` and `kvcodec bench` report them.", "",
             "KL: the mean KL divergence of the next-token distributions from the float16 cache's (nats per token; "
             "blank in a row measured before it was recorded).", "",
             "| codec | bits/element | x vs fp16 | perplexity change | agreement | KL | encode s/cache | decode s/cache | "
             "encode MB/s | decode MB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = "" if math.isnan(r.kl) else f"{r.kl:.4f}"
        lines.append(f"| `{r.codec}` | {r.bits_per_element:.3f} | {16 / r.bits_per_element:.2f} | "
                     f"{100 * r.ppl_change:+.3f}% | {100 * r.agreement:.2f}% | {kl} | {r.encode_s_per_cache:.2f} | "
                     f"{r.decode_s_per_cache:.2f} | {r.encode_MBps:.1f} | {r.decode_MBps:.1f} |")
    if calibration is not None:
        lines += ["", f"kvtc calibration {calibration.digest[:16]}... (not counted in the containers): "
                  f"{len(calibration.to_bytes()):,} bytes, {len(calibration.groups)} layer groups "
                  f"({', '.join(map(str, calibration.groups))}), {sum(b.components for b in calibration.keys)} key and "
                  f"{sum(b.components for b in calibration.values)} value components, from "
                  f"{calibration.settings.get('tokens')} tokens of {', '.join(calibration.settings.get('texts', []))}."]
    for text, text_rows in (per_text or {}).items():
        lines += ["", f"{text} alone:", "", "| codec | bits/element | perplexity change | agreement |", "|---|---|---|---|"]
        lines += [f"| `{r.codec}` | {r.bits_per_element:.3f} | {100 * r.ppl_change:+.3f}% | {100 * r.agreement:.2f}% |"
                  for r in sorted(text_rows, key=lambda r: (r.codec.split(":")[0], r.bits_per_element))]
    lines += ["", f"{made} Load average {os.getloadavg()[0]:.1f} at the end (the 2 cores are shared)."]
    RESULTS.mkdir(exist_ok=True)
    results_path(args, ".md").write_text("\n".join(lines) + "\n")
    results_path(args, ".json").write_text(json.dumps(
        {"texts": args.texts, "prefix_tokens": args.tokens, "continuation_tokens": args.continuation,
         "reference_ppl": reference_ppl, "rows": [r.to_dict() for r in rows]}, indent=2) + "\n")
    rate_distortion_plot(rows, str(results_path(args, ".png")), title=f"{model.model_id}: {', '.join(args.texts)}",
                         separate=ABLATIONS)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
